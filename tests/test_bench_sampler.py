"""dgrtools/bench/sampler.py runs and checks both sides agree; dgrtools/bench/e2e.py's --sampling names its results."""

from __future__ import annotations

import json
from pathlib import Path

from dgrtools.bench.e2e import SAMPLINGS, result_name
from dgrtools.bench.sampler import run


def test_sampler_bench_small(tmp_path: Path) -> None:
    payload = run(tmp_path, rows=(2, 3), repeats=1, vocab=2000)
    assert [(r["rows"], r["sampling"]) for r in payload["rows"]] == [
        (n, s) for n in (2, 3) for s in ("greedy", "typical", "top-p", "min-p-rep", "logprobs")]  # json: no vocab
    assert json.loads((tmp_path / "sampler.json").read_text())["vocab"] == 2000


def test_sampler_bench_with_a_gguf_vocabulary_runs_the_grammar(tmp_path: Path, tiny_model_path: Path) -> None:
    payload = run(tmp_path, rows=(3,), repeats=1, settings=("typical", "json"), model=tiny_model_path)
    assert [r["sampling"] for r in payload["rows"]] == ["typical", "json"] and payload["vocab"] == 512


def test_e2e_sampling_options() -> None:
    assert SAMPLINGS["greedy"].greedy
    assert (SAMPLINGS["typical"].temperature, SAMPLINGS["typical"].top_k, SAMPLINGS["typical"].top_p) == (0.8, 40, 0.95)
    assert (SAMPLINGS["top-p"].top_k, SAMPLINGS["top-p"].top_p) == (0, 0.95)
    assert result_name("gemma", "invariant") == "e2e-gemma-invariant"  # unchanged for greedy
    assert result_name("gemma", "fast", "top-p") == "e2e-gemma-fast-top-p"
