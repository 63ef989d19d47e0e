"""dgrtools/split_model.py and `dgr model split`: what a hop file holds, and what is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from consumer.cli import command_line
from consumer.engines.loader import SplitInfo, read_split_info
from dgrtools.split_model import split_gguf, split_route
from dgrtools.tiny_model import file_sha256, write_tiny_model

N_LAYER = 5


@pytest.fixture(scope="module")
def tiny5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("split") / "tiny5.gguf"
    write_tiny_model(path, n_layer=N_LAYER)
    return path


def _fields(path: Path) -> dict[str, object]:
    import gguf

    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensors(path: Path) -> dict[str, tuple[int, bytes]]:
    import gguf

    return {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_hop_file_holds_exactly_its_blocks(tiny5: Path, tmp_path_factory: pytest.TempPathFactory,
                                           data: st.DataObject) -> None:
    first = data.draw(st.integers(0, N_LAYER - 1))
    last = data.draw(st.integers(first + 1, N_LAYER))
    out = tmp_path_factory.mktemp("hop") / "hop.gguf"
    hop = split_gguf(tiny5, out, first, last)
    assert hop.sha256 == file_sha256(out) and hop.source_sha256 == file_sha256(tiny5)
    assert read_split_info(out) == SplitInfo(file_sha256(tiny5), first, last, N_LAYER)
    src_f, hop_f = _fields(tiny5), _fields(out)
    assert hop_f.pop("llama.block_count") == last - first
    src_f.pop("llama.block_count")
    split_keys = {k for k in hop_f if k.startswith("dgr.split.")}
    assert split_keys == {"dgr.split.source_sha256", "dgr.split.first_block", "dgr.split.last_block",
                          "dgr.split.source_block_count"}
    assert {k: v for k, v in hop_f.items() if k not in split_keys} == src_f  # every other key, unchanged
    src_t, hop_t = _tensors(tiny5), _tensors(out)
    want = {k: v for k, v in src_t.items() if not k.startswith("blk.")}
    for i in range(first, last):
        want.update({f"blk.{i - first}." + k.split(".", 2)[2]: v for k, v in src_t.items()
                     if k.startswith(f"blk.{i}.")})
    assert hop_t == want  # the range's blocks renumbered from 0, byte for byte, and nothing else


def test_split_refuses_bad_ranges_and_hop_files(tiny5: Path, tmp_path: Path) -> None:
    for a, b in [(0, 0), (3, 2), (-1, 2), (0, N_LAYER + 1)]:
        with pytest.raises(ValueError):
            split_gguf(tiny5, tmp_path / "x.gguf", a, b)
    hop = split_gguf(tiny5, tmp_path / "h.gguf", 1, 3)
    with pytest.raises(ValueError, match="already a hop"):
        split_gguf(hop.path, tmp_path / "y.gguf", 0, 1)
    with pytest.raises(ValueError):
        split_route(tiny5, tmp_path, (3, 2))
    assert not list(tmp_path.glob("*.tmp*"))


def test_gemma3_cut_must_keep_the_sliding_window_pattern(tmp_path: Path) -> None:
    """llama.cpp derives Gemma 3's sliding-window blocks from the block index (period 6): a hop must
    start at a multiple of 6. A metadata-only gemma3 file is enough to check the rule."""
    import gguf

    src = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(src), "gemma3")
    w.add_block_count(18)
    for i in range(18):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.full(4, i, np.float32))
    w.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for bad in (1, 5, 7, 13):
        with pytest.raises(ValueError, match="multiple of 6"):
            split_gguf(src, tmp_path / "bad.gguf", bad, 18)
    hops = split_route(src, tmp_path / "ok", (6, 12))
    assert [(h.first_block, h.last_block) for h in hops] == [(0, 6), (6, 12), (12, 18)]
    assert split_gguf(src, tmp_path / "end.gguf", 0, 9).last_block == 9  # any END is fine
    t = _tensors(hops[1].path)
    assert np.frombuffer(t["blk.0.attn_norm.weight"][1], np.float32)[0] == 6.0


def test_per_block_metadata_arrays_are_sliced(tmp_path: Path) -> None:
    """An `<arch>.` array with one entry per block (per-layer head counts...) keeps the range's entries."""
    import gguf

    src = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_block_count(4)
    w.add_array("llama.attention.head_count_kv", [1, 2, 3, 4])
    w.add_array("llama.other", [7, 8])  # not one per block: kept whole
    for i in range(4):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = _fields(split_gguf(src, tmp_path / "h.gguf", 1, 3).path)
    assert f["llama.attention.head_count_kv"] == [2, 3]
    assert f["llama.other"] == [7, 8]


def test_cli_model_split(tiny5: Path, tmp_path: Path) -> None:
    out = tmp_path / "hop.gguf"
    res = CliRunner().invoke(command_line(), ["model", "split", str(tiny5), "--blocks", "2:5", str(out)])
    assert res.exit_code == 0, res.output
    assert f"sha256={file_sha256(out)}" in res.output
    assert "blocks=2:5 of 5 (last hop)" in res.output
    assert f"source_sha256={file_sha256(tiny5)}" in res.output
    bad = CliRunner().invoke(command_line(), ["model", "split", str(tiny5), "--blocks", "2-5", str(out)])
    assert bad.exit_code != 0
    bad = CliRunner().invoke(command_line(), ["model", "split", str(tiny5), "--blocks", "4:9", str(out)])
    assert bad.exit_code != 0
