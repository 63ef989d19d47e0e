"""Route hops of recurrent and hybrid models: `dgr model split` cuts a tiny Mamba or Jamba at a block
boundary and the route computes exactly what the whole model does, or the cut is refused with a reason
(a hybrid hop must hold both block kinds: llama.cpp aborts otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from consumer.cli import command_line
from dgrtools.split_model import check_hybrid_cut, split_gguf, split_route

pytestmark = pytest.mark.llama


@pytest.mark.parametrize(("layout", "cuts"), [("recurrent", (1,)), ("hybrid", (2,))])
def test_route_equals_whole_model(tiny_layout_paths: dict[str, Path], tmp_path: Path, layout: str,
                                  cuts: tuple[int, ...]) -> None:
    pytest.importorskip("llama_cpp")
    from consumer.engines.llama import LlamaCppEngine
    from dgrtools.split_model import bench_route_decode

    src = tiny_layout_paths[layout]
    res = bench_route_decode(src, cuts, sessions=4, steps=6, prompt_len=12, repeats=1, out_dir=tmp_path)
    assert res["logits_bit_identical"] is True  # prefill + 6 fused decode steps, 4 sessions, every hop
    for hop in split_route(src, tmp_path / "again", cuts):
        e = LlamaCppEngine(hop.path, n_slots=2, ctx_per_session=64)
        try:
            assert e.state_layout.kind == layout  # each hop keeps its own blocks' state, of the same layout
            assert (e.boundary.first_layer, e.boundary.last_layer) == (hop.first_block, hop.last_block)
            assert e.identity.gguf_sha256 == hop.source_sha256
        finally:
            e.close()


@pytest.mark.parametrize("cuts", [(1,), (3,), (1, 2), (2, 3), (1, 3)])
def test_hybrid_cut_without_both_kinds_is_refused(tiny_hybrid_path: Path, tmp_path: Path,
                                                  cuts: tuple[int, ...]) -> None:
    """The tiny Jamba's blocks are Mamba, attention, Mamba, attention: a hop of [0, 1) has no attention
    block, one of [3, 4) no recurrent block; llama.cpp would abort the worker creating its context."""
    with pytest.raises(ValueError, match=r"hold no (attention|recurrent) block"):
        split_route(tiny_hybrid_path, tmp_path, cuts)
    assert not list(tmp_path.glob("*.gguf"))  # every hop is checked before any is written


@pytest.mark.parametrize("blocks", ["0:1", "3:4", "2:3"])
def test_cli_refuses_a_hybrid_hop_of_one_kind(tiny_hybrid_path: Path, tmp_path: Path, blocks: str) -> None:
    res = CliRunner().invoke(command_line(), ["model", "split", str(tiny_hybrid_path), "--blocks", blocks,
                                   str(tmp_path / "hop.gguf")])
    assert res.exit_code != 0 and not (tmp_path / "hop.gguf").exists()
    assert "hold no" in res.output


def test_hybrid_rules() -> None:
    check_hybrid_cut("jamba", [0, 4, 0, 4], 4, 0, 2)
    check_hybrid_cut("falcon-h1", 4, 8, 3, 4)  # every block has both
    check_hybrid_cut("llama", 4, 8, 3, 4)  # not a hybrid
    with pytest.raises(ValueError, match="no recurrent block"):
        check_hybrid_cut("granitehybrid", [4, 4, 0], 3, 0, 2)
    with pytest.raises(ValueError, match="does not split it"):
        check_hybrid_cut("qwen3next", 2, 48, 0, 24)


def test_hybrid_of_unknown_block_kinds_is_refused(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    src = tmp_path / "qwen3next.gguf"
    w = gguf.GGUFWriter(str(src), "qwen3next")
    w.add_block_count(4)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="qwen3next"):
        split_gguf(src, tmp_path / "hop.gguf", 0, 2)


@pytest.mark.parametrize(("layout", "cuts"), [("recurrent", (1,)), ("hybrid", (2,))])
def test_recurrent_hops_through_workers_equal_the_whole_model(
        real_redis: object, tiny_layout_paths: dict[str, Path], tmp_path: Path, layout: str,
        cuts: tuple[int, ...]) -> None:
    """The hop files behind real workers and the relay (tests/hop_driver.py): 4 sessions, long and short
    prompts in chunks of 24, give the whole model's tokens bit for bit."""
    pytest.importorskip("llama_cpp")
    from consumer.engines.llama import LlamaCppEngine
    from tests.hop_driver import RouteDriver, make_hop_worker
    from tests.support import prompts
    from tests.test_hop_worker import _assert_route_equals_whole

    src = tiny_layout_paths[layout]
    engines = [LlamaCppEngine(h.path, n_slots=8, ctx_per_session=256, n_threads=1)
               for h in split_route(src, tmp_path / "hops", cuts)]
    whole = LlamaCppEngine(src, n_slots=1, ctx_per_session=256, n_threads=1)
    try:
        d = RouteDriver(real_redis, [make_hop_worker(real_redis, e, f"{layout}-hop{k}")  # type: ignore[arg-type]
                                     for k, e in enumerate(engines)])
        ps = [*prompts(2, 500, seed=41, lo=40, hi=90), *prompts(2, 500, seed=42, lo=2, hi=9)]
        _assert_route_equals_whole(d, whole, ps, max_tokens=8, chunk=24)
    finally:
        for e in (*engines, whole):
            e.close()
