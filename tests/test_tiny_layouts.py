"""The generated tiny recurrent (Mamba) and hybrid (Jamba) GGUFs: byte-identical, the shape they
promise, loaded by llama.cpp as the layout they claim, and `dgr model tiny --layout`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from consumer.cli import command_line
from dgrtools.tiny_model import file_sha256
from dgrtools.tiny_recurrent import HYBRID_ATTENTION_BLOCKS, TINY_JAMBA, TINY_MAMBA, write_tiny

# Pinned: the default tiny models of each layout (seed 0). A change here changes every identity hash
# computed from them; update only on purpose (numpy or gguf changing their output would show here).
PINNED = {
    ("recurrent", "q8_0"): "4690a918d3b88caee6d73db87c9c2cda7cc3b1db8ef1ff1685517e0e4a2e7efc",
    ("recurrent", "f32"): "6ff02537aa19256d9dd60315496f14b3103d51078d40e212d5597fb3fcc78d14",
    ("hybrid", "q8_0"): "d1a2f6376f814eb742ed8b7aa8ddd0e380d7bd637d1be5069398f03cffc91491",
    ("hybrid", "f32"): "12b7eb7f1d49008bfa8aab1348b788c7320b5e00c9efde909d2617195c627d8d",
}


def _reader(path: Path):  # type: ignore[no-untyped-def]
    import gguf

    return gguf.GGUFReader(str(path))


def test_defaults_are_pinned(tiny_recurrent_path: Path, tiny_hybrid_path: Path) -> None:
    assert file_sha256(tiny_recurrent_path) == PINNED["recurrent", "q8_0"]
    assert file_sha256(tiny_hybrid_path) == PINNED["hybrid", "q8_0"]


@pytest.mark.parametrize(("layout", "quant"), sorted(PINNED))
def test_generation_is_byte_identical_and_seeded(tmp_path: Path, layout: str, quant: str) -> None:
    a = write_tiny(tmp_path / "a.gguf", layout, quant=quant)  # type: ignore[arg-type]
    assert a == PINNED[layout, quant]
    assert write_tiny(tmp_path / "b.gguf", layout, quant=quant) == a  # type: ignore[arg-type]
    assert write_tiny(tmp_path / "c.gguf", layout, seed=1, quant=quant) != a  # type: ignore[arg-type]
    assert not (tmp_path / "a.gguf.tmp").exists()


def test_recurrent_shape_and_types(tiny_recurrent_path: Path) -> None:
    import gguf

    r = _reader(tiny_recurrent_path)
    f = {k: r.get_field(k).contents() for k in r.fields if not k.startswith(("GGUF.", "tokenizer."))}  # type: ignore[union-attr]
    assert f["general.architecture"] == "mamba"
    c = TINY_MAMBA
    assert (f["mamba.block_count"], f["mamba.embedding_length"], f["mamba.ssm.inner_size"], f["mamba.ssm.state_size"],
            f["mamba.ssm.conv_kernel"], f["mamba.ssm.time_step_rank"]) == (2, 128, 256, 16, 4, 8)
    assert c.d_inner == 2 * c.n_embd  # the only expansion factor llama.cpp supports
    types = {t.name: gguf.GGMLQuantizationType(int(t.tensor_type)).name for t in r.tensors}
    # rows of whole 32-value blocks: Q8_0; what the ssm ops read, and ssm_dt (rows of 8): f32
    for name in ("token_embd.weight", "output.weight", "blk.0.ssm_in.weight", "blk.0.ssm_x.weight",
                 "blk.1.ssm_out.weight"):
        assert types[name] == "Q8_0", name
    for name in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_conv1d.bias", "blk.0.ssm_a", "blk.0.ssm_d",
                 "blk.0.ssm_dt.weight", "blk.0.ssm_dt.bias", "blk.1.attn_norm.weight", "output_norm.weight"):
        assert types[name] == "F32", name
    assert len(r.tensors) == 3 + 10 * 2
    a = next(t for t in r.tensors if t.name == "blk.0.ssm_a")
    assert (np.asarray(a.data) < 0).all()  # A = -exp(.): every state decays


def test_hybrid_shape_and_types(tiny_hybrid_path: Path) -> None:
    r = _reader(tiny_hybrid_path)
    assert r.get_field("general.architecture").contents() == "jamba"  # type: ignore[union-attr]
    kv = r.get_field("jamba.attention.head_count_kv").contents()  # type: ignore[union-attr]
    assert kv == [2 if i in HYBRID_ATTENTION_BLOCKS else 0 for i in range(TINY_JAMBA.n_layer)] == [0, 2, 0, 2]
    names = {t.name for t in r.tensors}
    for i in range(4):
        attention = i in HYBRID_ATTENTION_BLOCKS
        assert (f"blk.{i}.attn_q.weight" in names) == attention
        assert (f"blk.{i}.ssm_in.weight" in names) != attention
        assert (f"blk.{i}.ssm_b_norm.weight" in names) != attention  # Jamba's norms on dt, B and C
        assert f"blk.{i}.ffn_down.weight" in names  # every Jamba block has an FFN


def test_llama_cpp_loads_each_as_its_layout(tiny_recurrent_path: Path, tiny_hybrid_path: Path,
                                             tiny_model_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from consumer.engines.llama import llama_cpp_module

    L = llama_cpp_module()
    for path, recurrent, hybrid in ((tiny_model_path, False, False), (tiny_recurrent_path, True, False),
                                    (tiny_hybrid_path, False, True)):
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = False
        m = L.llama_model_load_from_file(str(path).encode(), mp)
        assert m, path
        try:
            assert (bool(L.llama_model_is_recurrent(m)), bool(L.llama_model_is_hybrid(m))) == (recurrent, hybrid)
        finally:
            L.llama_model_free(m)


def test_cli_model_tiny_layout(tmp_path: Path) -> None:
    for layout in ("recurrent", "hybrid"):
        out = tmp_path / f"{layout}.gguf"
        res = CliRunner().invoke(command_line(), ["model", "tiny", str(out), "--layout", layout])
        assert res.exit_code == 0, res.output
        assert f"sha256={PINNED[layout, 'q8_0']}" in res.output
    res = CliRunner().invoke(command_line(), ["model", "tiny", str(tmp_path / "kv.gguf")])  # default: the tiny llama
    assert res.exit_code == 0 and _reader(tmp_path / "kv.gguf").get_field("general.architecture").contents() == "llama"  # type: ignore[union-attr]
    bad = CliRunner().invoke(command_line(), ["model", "tiny", str(tmp_path / "x.gguf"), "--layout", "rwkv"])
    assert bad.exit_code != 0 and not (tmp_path / "x.gguf").exists()
