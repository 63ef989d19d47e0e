"""The parts of `dgr bench peer` (dgrtools/bench/llamacpp_build, cpu_probe, rates, llama_server), the pure parts:
flags and commands, log parsing, rates, the streaming client. No build."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from consumer import cpuinfo
from dgrtools.bench import cpu_probe, llama_server, llamacpp_build, rates

EPYC_FLAGS = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi2 avx2 avx512f avx512dq avx512cd avx512bw "
              "avx512vl avx512_bf16 avx512vbmi avx512_vnni")
SERVER_LINE = ("main: system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | "
               "AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | OPENMP = 1 | "
               "REPACK = 1 | ")


# ------------------------------------------------------------------------------------ flags, commands
def test_cpu_flags_reads_the_first_flags_line():
    text = f"processor\t: 0\nflags\t\t: {EPYC_FLAGS}\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpuinfo.cpu_flags(text) == set(EPYC_FLAGS.split())
    assert cpuinfo.cpu_flags("nothing here") == set()


def test_cmake_flags_follow_the_cpu_and_never_enable_amx():
    flags = llamacpp_build.cmake_flags(set(EPYC_FLAGS.split()) | {"amx_tile", "amx_int8", "amx_bf16"})
    assert "-DGGML_NATIVE=OFF" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any(f.startswith("-DGGML_AMX") and f.endswith("=ON") for f in flags)
    for on in ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX512_VBMI", "FMA", "F16C"):
        assert f"-DGGML_{on}=ON" in flags
    assert "-DGGML_AVX_VNNI=OFF" in flags  # the VEX AVX-VNNI is not in these flags: SIGILL if enabled
    assert {"-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"} <= set(flags)
    # AVX512 needs all of F, CD, VL, DQ, BW
    partial = llamacpp_build.cmake_flags({"avx2", "avx512f"})
    assert "-DGGML_AVX512=OFF" in partial and "-DGGML_AVX2=ON" in partial
    # each option given exactly once
    names = [f.split("=")[0] for f in flags]
    assert len(names) == len(set(names))


def test_cmake_flags_unknown_cpu_switches_every_feature_off():
    flags = llamacpp_build.cmake_flags(set())
    assert all(f.endswith("=OFF") for f in flags if f.startswith("-DGGML_") and f != "-DGGML_NATIVE=OFF")


def test_configure_and_build_commands(tmp_path):
    conf = llamacpp_build.configure_cmd(tmp_path / "src", tmp_path / "build", ["-DX=1"], generator="Ninja")
    assert conf == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build"), "-G", "Ninja", "-DX=1"]
    assert "-G" not in llamacpp_build.configure_cmd(tmp_path, tmp_path, [])
    assert llamacpp_build.build_cmd(tmp_path / "b", jobs=2) == ["cmake", "--build", str(tmp_path / "b"), "-j", "2",
                                                      "--target", "llama-server"]
    dl = llamacpp_build.sdist_download_cmd(tmp_path)
    assert dl[1:] == ["-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                      f"llama-cpp-python=={llamacpp_build.SDIST_VERSION}", "-d", str(tmp_path)]


def test_vendored_commit_follows_the_submodule_gitdir(tmp_path):
    root = tmp_path / "llama_cpp_python-0.3.36"
    sub = root / "vendor" / "llama.cpp"
    sub.mkdir(parents=True)
    gitdir = root / ".git" / "modules" / "vendor" / "llama.cpp"
    gitdir.mkdir(parents=True)
    (sub / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")
    sha = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    (gitdir / "HEAD").write_text(sha + "\n")
    assert llamacpp_build.vendored_commit(root) == sha
    # a symbolic HEAD resolved through packed-refs
    (gitdir / "HEAD").write_text("ref: refs/heads/master\n")
    (gitdir / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/master\n")
    assert llamacpp_build.vendored_commit(root) == sha
    assert llamacpp_build.vendored_commit(tmp_path / "nowhere") is None


def test_build_percent_reads_make_and_ninja_logs():
    assert llamacpp_build.build_percent("[  3%] Building\n[ 42%] Building C object") == 42
    assert llamacpp_build.build_percent("[1/200] a\n[50/200] b") == 25
    assert llamacpp_build.build_percent("-- Configuring done") is None


def test_build_server_reuses_an_existing_binary(tmp_path, monkeypatch):
    binary = llamacpp_build.server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    (tmp_path / "build.json").write_text(json.dumps({"build_seconds": 512.0, "llama_cpp_commit": "abc"}))

    def boom(*a, **k):
        raise AssertionError("must not build")

    monkeypatch.setattr(llamacpp_build.subprocess, "run", boom)
    monkeypatch.setattr(llamacpp_build.subprocess, "Popen", boom)
    rec = llamacpp_build.build_server(tmp_path)
    assert rec["reused"] is True and rec["build_seconds"] == 512.0 and rec["binary"] == str(binary)


# ---------------------------------------------------------------------------------- system info
def test_parse_server_system_info_ignores_thread_counts():
    line = cpu_probe.server_system_info("load...\n" + SERVER_LINE + "\nmain: loading model\n")
    assert line is not None and line.startswith("n_threads = 2")
    feats = cpu_probe.parse_system_info(line)
    assert feats == ["SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2", "AVX512", "LLAMAFILE", "OPENMP", "REPACK"]
    # n_threads = 1 must not read as a feature
    assert "n_threads" not in cpu_probe.parse_system_info("n_threads = 1 (n_threads_batch = 1) / 2 | CPU : AVX = 1 |")
    assert cpu_probe.server_system_info("no such line") is None


def test_compare_features():
    d = cpu_probe.compare_features(["AVX2", "AVX512", "AVX512_VNNI"], ["AVX2", "AVX512", "AMX_INT8"])
    assert d == {"only_dgr": ["AVX512_VNNI"], "only_server": ["AMX_INT8"]}


# ---------------------------------------------------------------------------------------- rates
def test_window_rate_counts_only_the_all_decoding_window():
    # session a: tokens at 0..10, session b starts late (first token at 2) and ends at 10
    a = [float(t) for t in range(11)]
    b = [2.0 + 0.5 * k for k in range(17)]  # 2.0 .. 10.0
    # window (2, 10]: a has 8 tokens, b has 16
    assert rates.window_rate([a, b]) == pytest.approx(24 / 8)
    assert rates.window_rate([[1.0], [2.0]]) == 0.0
    assert rates.window_rate([]) == 0.0


def test_wall_rate_and_ratio():
    assert rates.wall_rate(128, 10.0, [[11.0, 12.0], [11.5, 14.0]]) == pytest.approx(128 / 4.0)
    assert rates.wall_rate(0, 0.0, []) == 0.0
    assert rates.ratio(90.0, 100.0) == pytest.approx(0.9)
    assert math.isnan(rates.ratio(1.0, 0.0))


def test_summarize_takes_medians_and_agreement():
    R = rates.SideResult
    runs = {"dgr": [R(10.0, 12.0, 100.0, [[1, 2]], {"mean_batch": 8.0}), R(30.0, 14.0, 300.0, [[1, 2]], {}),
                    R(20.0, 13.0, 200.0, [[1, 2]], {"mean_batch": 7.0})]}
    s = rates.summarize(runs)["dgr"]
    assert (s["wall_tok_s"], s["decode_tok_s"], s["ttft_ms"]) == (20.0, 13.0, 200.0)
    assert s["mean_batch"] == 7.5 and s["wall_runs"] == [10.0, 30.0, 20.0]
    agree = rates.token_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert agree == {"identical_sessions": 1, "sessions": 2, "mean_common_prefix": 2.0}
    assert rates.common_prefix([1, 2], [1, 2, 3]) == 2


def test_peer_ratios_from_medians_and_per_repeat():
    R = rates.SideResult
    runs = {"raw fused": [R(40.0, 40.0, float("nan"), [], {})],
            "dgr": [R(10.0, 20.0, 1.0, [], {})],
            "llama-server": [R(20.0, 40.0, 1.0, [], {"timings_decode_tok_s": 50.0})],
            "llama-server --no-repack": [R(5.0, 10.0, 1.0, [], {})]}
    r = rates.peer_ratios(rates.summarize(runs), runs, no_repack=True)
    assert (r["wall_dgr_over_server"], r["decode_dgr_over_server"]) == (0.5, 0.5)
    assert r["decode_dgr_over_server_timings"] == pytest.approx(0.4)
    assert (r["decode_dgr_over_raw"], r["decode_server_over_raw"]) == (0.5, 1.0)
    assert r["paired_wall_dgr_over_server"] == [0.5] and r["paired_decode_dgr_over_server_no_repack"] == [2.0]
    assert (r["wall_dgr_over_server_no_repack"], r["decode_dgr_over_server_no_repack"]) == (2.0, 2.0)


# ------------------------------------------------------------------------------------ llama-server
def test_server_cmd_is_loopback_and_drops_flags_this_build_lacks(tmp_path):
    help_text = "--cont-batching --no-kv-unified --cache-ram N --flash-attn [on|off|auto]"
    cmd = llama_server.server_cmd(tmp_path / "llama-server", tmp_path / "m.gguf", port=8123, threads=2, sessions=8,
                          ctx_per_session=256, help_text=help_text)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("-np") + 1] == "8" and cmd[cmd.index("-c") + 1] == str(8 * 256)
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-tb") + 1] == "2"
    assert "--no-webui" not in cmd  # not in this help text
    assert {"--cont-batching", "--no-kv-unified"} <= set(cmd)
    assert cmd[cmd.index("--cache-ram") + 1] == "0" and cmd[cmd.index("-fa") + 1] == "on"
    full = llama_server.server_cmd(tmp_path / "s", tmp_path / "m", port=1, threads=1, sessions=1, ctx_per_session=256,
                           extra=["--no-repack"])
    assert "--no-webui" in full and full[-1] == "--no-repack"


def test_completion_body_is_greedy_fixed_length_no_cache():
    body = llama_server.completion_body([2, 651, 6037], 64)
    assert body["prompt"] == [2, 651, 6037] and body["n_predict"] == 64
    assert body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["ignore_eos"] is True and body["cache_prompt"] is False and body["stream"] is True


def test_parse_sse_line():
    assert llama_server.parse_sse_line(b'data: {"tokens": [5], "stop": false}\n') == {"tokens": [5], "stop": False}
    assert llama_server.parse_sse_line(b"\n") is None
    assert llama_server.parse_sse_line(b": keep-alive\n") is None
    assert llama_server.parse_sse_line(b"data: [DONE]\n") is None


def test_prompts_are_distinct():
    ps = llama_server.prompts_for(40)
    assert len(ps) == 40 and len(set(ps)) == 40 and ps[0] == llama_server.PROMPTS[0]


class _FakeCompletion(BaseHTTPRequestHandler):
    """Streams n_predict tokens as llama-server does: one SSE event per token, then a stop event."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["n_predict"]
        for k in range(n):
            if k == 2:  # llama-server holds back a token ending inside a UTF-8 character: no event
                continue
            ev = {"tokens": [body["prompt"][-1] + k], "stop": False, "tokens_predicted": k + 1}
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
            self.wfile.flush()
        final = {"tokens": [], "stop": True, "tokens_predicted": n,
                 "timings": {"predicted_per_second": 10.0, "prompt_ms": 5.0}}
        self.wfile.write(f"data: {json.dumps(final)}\n\n".encode())
        self.close_connection = True

    def log_message(self, *a) -> None:
        pass


def test_complete_many_against_a_fake_server(tmp_path: Path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletion)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        srv = llama_server.LlamaServer.__new__(llama_server.LlamaServer)  # no binary: only the client half
        srv.name, srv.port, srv.log_path = "fake", httpd.server_address[1], tmp_path / "fake.log"
        srv.log_path.write_text("")
        res = srv.complete_many([[1, 100], [1, 200], [1, 300]], 5)
        # the held-back token (k == 2) is counted but its id is not known
        assert res.tokens == [[b + k for k in range(5) if k != 2] for b in (100, 200, 300)]
        assert res.wall_tok_s > 0 and res.ttft_ms >= 0
        assert res.extra["timings_decode_tok_s"] == pytest.approx(30.0)
        assert res.extra["timings_prompt_ms_median"] == pytest.approx(5.0)
    finally:
        httpd.shutdown()
