"""The prefix cache through the whole service path (producer -> real Redis -> worker -> llama.cpp
`invariant`, tiny model): later sessions restore the shared prefix (hits counted) and every session's
tokens equal the session alone with no cache, greedy and sampled, under the shape probe too (a hit whose
KV came from another piece shape would differ); a budget of one entry evicts mid-run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from consumer.engines.base import Engine
from consumer.engines.llama import LlamaCppEngine
from schemas import Sampling
from schemas.prefix import BLOCK_TOKENS, PrefixSummary, block_ids, prefix_root
from tests.fixtures.shape_probe import ShapeProbeEngine
from tests.fixtures.windowed import WindowedTiny
from tests.invariance_harness import Conditions, Session, oracle, random_prompt, run_scenario

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def client(redis_server: object) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)  # type: ignore[attr-defined]
    yield c
    c.close()


def _sessions() -> list[Session]:
    rng = np.random.default_rng(7)
    shared = random_prompt(rng, 200, 512)
    samplings = [Sampling(), Sampling(temperature=0.8, seed=5, repetition_penalty=1.3),
                 Sampling(temperature=0.7, seed=1), Sampling()]
    return [Session(prompt=shared + random_prompt(rng, 5 + 7 * k, 512), sampling=samplings[k], max_tokens=8,
                    start_s=0.15 * k) for k in range(4)]


@pytest.mark.parametrize("probe", [False, True])
@pytest.mark.parametrize(("budget", "chunk", "prefill_budget"), [(64 << 20, 512, 512), (64 << 20, 64, 7),
                                                                 (600_000, 99, 100)])
def test_hits_are_bit_identical_to_solo(tiny_model_path: Path, client: redis.Redis, probe: bool, budget: int,
                                        chunk: int, prefill_budget: int) -> None:
    def make(n_slots: int) -> Engine:
        e: Engine = LlamaCppEngine(tiny_model_path, recipe="invariant", n_slots=n_slots, ctx_per_session=512)
        return ShapeProbeEngine(e) if probe else e  # type: ignore[return-value]

    solo_engine = make(1)
    ss = _sessions()
    c = Conditions(n_slots=4, prefill_budget=prefill_budget, prefill_chunk=chunk, prefix_cache_bytes=budget,
                   prefix_cache_scope="global")
    out = run_scenario(client, ss, c, make, lambda s, stops: oracle(solo_engine, s, stops))
    assert out.mismatches == []
    assert out.prefix_hit_tokens >= 48  # later sessions restored shared blocks (how many: timing)
    # billed apart: every restored token charged once as cached (a part of prompt_tokens, which the harness
    # checks is each prompt's length), nothing restored uncounted (no replay here)
    assert out.cached_tokens == out.prefix_hit_tokens
    # advertised: the shared prefix's blocks (rooted in the prefill key's digest, scope global) are in the
    # heartbeat's bounded summary, and the counters in the lane's info
    summary = PrefixSummary.parse(out.info["prefix"])
    assert summary is not None and summary.scope == "global" and summary.block_tokens == BLOCK_TOKENS
    digest = out.info["engines"][0]["digests"]["prefill"]
    held = block_ids(ss[0].prompt[:192], prefix_root(digest, ""))
    assert held[-1] in summary.ids  # the deepest shared block (indexed under every entry that covers it)
    stats = out.info["engines"][0]["prefix_cache"]
    assert stats["hits"] >= 1 and stats["hit_tokens"] == out.prefix_hit_tokens and 0 < stats["bytes"] <= budget


def test_scope_account_does_not_share_across_accounts(tiny_model_path: Path, client: redis.Redis) -> None:
    """The harness gives sessions alternating accounts: under scope account only same-account sessions hit."""
    solo_engine = LlamaCppEngine(tiny_model_path, recipe="invariant", n_slots=1, ctx_per_session=512)
    ss = _sessions()[:2]  # two sessions, two accounts
    c = Conditions(n_slots=2, prefix_cache_bytes=64 << 20, prefix_cache_scope="account")
    out = run_scenario(client, ss, c, lambda n: LlamaCppEngine(tiny_model_path, recipe="invariant", n_slots=n,
                                                                ctx_per_session=512),
                       lambda s, stops: oracle(solo_engine, s, stops))
    assert out.mismatches == []
    assert out.prefix_hit_tokens == 0 and out.cached_tokens == 0


def test_a_sliding_window_engine_caches_prompts_longer_than_its_window(tiny_model_path: Path,
                                                                       client: redis.Redis) -> None:
    """Prompts of 205-226 tokens, a window of 64, a prefill budget that takes a whole prompt in one piece: the
    scheduler ends each cacheable prompt's piece at the window's edge, so the first session's state is saved
    there and later sessions restore its 4 blocks (without the cut: no hit at all); tokens still equal solo."""
    solo_engine = LlamaCppEngine(tiny_model_path, recipe="invariant", n_slots=1, ctx_per_session=512)
    ss = _sessions()
    c = Conditions(n_slots=4, prefill_budget=512, prefill_chunk=512, prefix_cache_bytes=64 << 20,
                   prefix_cache_scope="global")
    out = run_scenario(client, ss, c, lambda n: WindowedTiny(tiny_model_path, recipe="invariant", n_slots=n,
                                                             ctx_per_session=512),
                       lambda s, stops: oracle(solo_engine, s, stops))
    assert out.mismatches == []
    assert out.prefix_hit_tokens >= 64 and out.prefix_hit_tokens % 64 == 0, out.prefix_hit_tokens
    assert out.cached_tokens == out.prefix_hit_tokens
