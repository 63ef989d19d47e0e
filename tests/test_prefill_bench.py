"""`dgr bench prefill --quick`: the smoke test of the prefill-heavy benchmark (tiny model, a private
redis-server, a consumer subprocess, no llama-server). Checks what it reports, never how fast."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from consumer.cli import command_line
from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.bench.prefill import raw_prefill, wave_prompts


def test_raw_prefill_packs_prompts_into_calls_and_samples_each_prompt_once(tiny_model_path: Path) -> None:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=256, max_tokens_per_call=100)
    try:
        prompts = wave_prompts(3, 70, eng.capacity.vocab_size, 0, None)
        assert len({tuple(p) for p in prompts}) == 3 and all(len(p) == 70 for p in prompts)
        w = raw_prefill(eng, prompts)
        assert w.extra["calls"] == 3  # 210 rows in calls of <= 100
        assert len(w.first) == 3 and w.first == sorted(w.first) and max(w.first) == w.wall
        alone = [raw_prefill(eng, [p]).tokens[0] for p in prompts]
        assert w.tokens == alone  # the reference engine is exact: packing does not change a prompt's token
    finally:
        eng.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_quick_mode_runs_the_service_and_the_raw_engine(tmp_path: Path) -> None:
    res = CliRunner().invoke(command_line(), ["bench", "prefill", "--quick", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    payload = json.loads((tmp_path / "prefill-tiny-fast.json").read_text())
    assert set(payload["summary"]) == {"raw engine", "dgr"}
    assert payload["sessions"] == 4 and payload["prompt_len"] == 64
    assert payload["ratios"]["dgr_prefill_over_raw"] > 0
    dgr = payload["runs"]["dgr"][0]
    assert len(dgr["first"]) == 4 and dgr["wall"] >= max(dgr["first"])
    # 256 prompt tokens and nothing decoding: one burst call (the consumer's default --prefill-burst)
    assert dgr["prefill_calls"] == 1
