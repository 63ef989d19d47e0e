"""NumpyReferenceEngine: the protocol, position checks with rollback, release, invariance by design."""

from __future__ import annotations

import numpy as np
import pytest

from consumer.batch import BatchRow, FusedBatch
from consumer.engines import Engine, EngineError, engine_key
from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.tiny_model import TINY, file_sha256

PROMPT = [1, 300, 301, 302, 400, 401]


@pytest.fixture
def ref(tiny_model_path):
    return NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=64, max_tokens_per_call=32)


def prefill(engine, slot, tokens, start=0, all_logits=False):
    rows = [BatchRow(slot, start + i, t, all_logits or i == len(tokens) - 1) for i, t in enumerate(tokens)]
    return engine.step(FusedBatch.from_rows("prefill", rows))


def test_protocol_and_contract_fields(ref, tiny_model_path):
    assert isinstance(ref, Engine)
    assert ref.batch_invariant is True
    assert ref.identity.architecture == "llama"
    assert ref.identity.gguf_sha256 == file_sha256(tiny_model_path)
    r = ref.recipe
    assert (r.quantization, r.kv_cache_type, r.ctx_per_session, r.flash_attention, r.batch_invariant, r.runtime) == \
        ("Q8_0", "f32", 64, False, True, "numpy-reference/1")
    assert (ref.boundary.first_layer, ref.boundary.last_layer) == (0, TINY.n_layer)
    assert ref.state_layout.kind == "kv"
    assert ref.state_layout.dims == {"n_layer": 2, "n_head_kv": 2, "head_dim": 32, "n_embd_k_gqa": 64,
                                     "n_ctx_per_seq": 64}
    assert (ref.capacity.n_slots, ref.capacity.ctx_per_session, ref.capacity.max_tokens_per_call,
            ref.capacity.vocab_size) == (4, 64, 32, TINY.n_vocab)
    assert engine_key(ref, "decode").digest != engine_key(ref, "prefill").digest
    d = ref.describe()
    assert d["backend"] == "numpy-reference/1" and d["quantization"] == "Q8_0"


def test_logits_shape_and_order(ref):
    out = prefill(ref, 0, PROMPT, all_logits=True)
    assert out.shape == (len(PROMPT), TINY.n_vocab) and out.dtype == np.float32
    assert np.isfinite(out).all()
    # rows that do not ask for logits are not returned
    ref.release(0)
    last = prefill(ref, 0, PROMPT)
    assert last.shape == (1, TINY.n_vocab)
    assert np.array_equal(last[0], out[-1])


def test_chunked_prefill_equals_one_call(ref):
    whole = prefill(ref, 0, PROMPT, all_logits=True)
    parts = [prefill(ref, 1, PROMPT[:2], all_logits=True), prefill(ref, 1, PROMPT[2:5], start=2, all_logits=True),
             prefill(ref, 1, PROMPT[5:], start=5, all_logits=True)]
    assert np.array_equal(whole, np.concatenate(parts))


def test_wrong_position_is_rejected_and_rolled_back(ref):
    prefill(ref, 0, PROMPT[:3])
    prefill(ref, 1, PROMPT[:2])
    with pytest.raises(EngineError) as ei:  # slot 1's next position is 2, not 3
        ref.step(FusedBatch.from_rows("decode", [BatchRow(0, 3, 5, True), BatchRow(1, 3, 5, True)]))
    assert ei.value.slots == (1,)
    assert "slot 1" in str(ei.value)
    assert (ref.next_position(0), ref.next_position(1)) == (3, 2)  # nothing moved, slot 0 included
    # continuing correctly gives exactly what an undisturbed engine gives
    got = ref.step(FusedBatch.from_rows("decode", [BatchRow(0, 3, 5, True), BatchRow(1, 2, 5, True)]))
    fresh = NumpyReferenceEngine(ref.model_path, n_slots=4, ctx_per_session=64)
    prefill(fresh, 0, PROMPT[:3])
    prefill(fresh, 1, PROMPT[:2])
    want = fresh.step(FusedBatch.from_rows("decode", [BatchRow(0, 3, 5, True), BatchRow(1, 2, 5, True)]))
    assert np.array_equal(got, want)


def test_first_token_must_be_at_position_zero(ref):
    with pytest.raises(EngineError) as ei:
        ref.step(FusedBatch.from_rows("prefill", [BatchRow(2, 4, 7, True)]))
    assert ei.value.slots == (2,)
    # a gap inside one call is caught too
    with pytest.raises(EngineError):
        ref.step(FusedBatch.from_rows("prefill", [BatchRow(2, 0, 7, False), BatchRow(2, 2, 7, True)]))
    assert ref.next_position(2) == 0


@pytest.mark.parametrize("rows,slots", [
    ([BatchRow(4, 0, 7, True)], (4,)),  # slot out of range
    ([BatchRow(0, 0, TINY.n_vocab, True)], (0,)),  # token out of vocabulary
    ([BatchRow(0, 0, -1, True)], (0,)),
])
def test_bad_rows_are_rejected(ref, rows, slots):
    with pytest.raises(EngineError) as ei:
        ref.step(FusedBatch.from_rows("prefill", rows))
    assert ei.value.slots == slots


def test_batch_limits(ref):
    with pytest.raises(EngineError):
        ref.step(FusedBatch.from_rows("prefill", [BatchRow(0, i, 5, False) for i in range(33)]))
    with pytest.raises(EngineError):
        ref.step(FusedBatch.from_rows("prefill", []))
    small = NumpyReferenceEngine(ref.model_path, n_slots=1, ctx_per_session=4)
    prefill(small, 0, PROMPT[:4])
    with pytest.raises(EngineError, match="ctx_per_session"):
        small.step(FusedBatch.from_rows("decode", [BatchRow(0, 4, 5, True)]))


def test_release_clears_the_slot(ref):
    first = prefill(ref, 0, PROMPT)
    prefill(ref, 0, [9, 9], start=len(PROMPT))
    ref.release(0)
    assert ref.next_position(0) == 0
    with pytest.raises(EngineError):
        ref.step(FusedBatch.from_rows("decode", [BatchRow(0, len(PROMPT) + 2, 5, True)]))
    assert np.array_equal(prefill(ref, 0, PROMPT), first)


def test_rows_do_not_depend_on_the_batch(ref):
    """Same session, alone vs next to three others: bit-identical (the property the design promises)."""
    alone = prefill(ref, 0, PROMPT, all_logits=True)
    ref.release(0)
    rows = []
    others = [[1, 5, 6, 7], [1, 260, 261], [1, 450, 451, 452, 453, 454, 455]]
    for s, p in enumerate(others, start=1):
        rows += [BatchRow(s, i, t, True) for i, t in enumerate(p)]
    rows[3:3] = [BatchRow(0, i, t, True) for i, t in enumerate(PROMPT)]  # interleaved in the middle
    out = ref.step(FusedBatch.from_rows("prefill", rows))
    assert np.array_equal(out[3:3 + len(PROMPT)], alone)


def test_layer_ranges_compose(ref):
    """The hop structure: embed -> layers [0,1) -> layers [1,2) -> head equals the whole model."""
    whole = prefill(ref, 0, PROMPT, all_logits=True)
    out = []
    for pos, t in enumerate(PROMPT):
        h = ref.embed(t)
        h = ref.run_layers(1, pos, h, 0, 1)
        h = ref.run_layers(1, pos, h, 1, TINY.n_layer)
        out.append(ref.head(h))
    assert np.array_equal(np.stack(out), whole)


def test_non_llama_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="llama"):
        NumpyReferenceEngine(path)
