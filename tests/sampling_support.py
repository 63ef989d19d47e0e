"""Hypothesis strategies shared by the sampler tests: a `Sampling` with every control drawn."""

from __future__ import annotations

from hypothesis import strategies as st

from schemas import Sampling


def draw_ids(draw: st.DrawFn, vocab: int, most: int) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(0, vocab + 3), max_size=most, unique=True)))


@st.composite
def samplings(draw: st.DrawFn, vocab: int) -> Sampling:
    banned = draw_ids(draw, vocab, 6)
    allowed = draw(st.none() | st.lists(st.integers(0, vocab + 3), min_size=1, max_size=12, unique=True))
    if allowed is not None and set(allowed) <= set(banned):
        allowed = None
    return Sampling(
        temperature=draw(st.sampled_from([0.0, 0.0, 1.0, 1e-6, 2e-5]) | st.floats(0.01, 10.0)),
        top_k=draw(st.sampled_from([0, 0, 1, 2, vocab, vocab + 7]) | st.integers(1, max(1, vocab - 1))),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.999, 1 - 1e-7, 0.5, 0.25]) | st.floats(0.01, 1.0, exclude_min=True)),
        min_p=draw(st.sampled_from([0.0, 0.0, 1.0]) | st.floats(0.0, 1.0)),
        seed=draw(st.integers(0, 2**63 - 1)),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 0.5, 1.3, 10.0])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.7, -1.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.3, -0.2])),
        penalty_last_n=draw(st.sampled_from([64, -1, 0, 3])),
        penalize_prompt=draw(st.booleans()),
        # whole-number biases tie with whole-number logits: the lowest-id rule at every cut
        logit_bias=tuple((t, draw(st.sampled_from([1.0, 2.0, -1.0]) | st.floats(-100, 100)))
                         for t in draw_ids(draw, vocab, 4)),
        min_tokens=draw(st.sampled_from([0, 0, 2, 50])),
        allowed_token_ids=None if allowed is None else tuple(allowed),
        banned_token_ids=banned,
        allow_special=draw(st.booleans()),
        logprobs=draw(st.sampled_from([None, None, 0, 1, 5, 20])),
    )
