"""The sampling controls through the service (issue 23): a worker with the tiny llama.cpp model, its own
vocabulary (special tokens masked, grammars), real answers on the wire. Log-probabilities travel with
each token; a grammar-constrained session's output follows its grammar and ends with a clear answer; a
grammar the worker cannot run is refused at the opening; a row with no token left ends its session
`no_token`; every control gives the same tokens (and log-probabilities) alone as batched."""

from __future__ import annotations

import json
from pathlib import Path

import fakeredis
import pytest
import redis

from consumer.engines.llama import LlamaCppEngine
from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.tokenizer import Tokenizer
from schemas import Reason, Sampling, Status

from .hostile_support import Honest, make_worker

EOS, BOS = 2, 1  # the tiny model's end of generation and its special <s>
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> LlamaCppEngine:
    return LlamaCppEngine(tiny_model_path, recipe="invariant", n_slots=8, ctx_per_session=256)


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


@pytest.fixture
def client() -> redis.Redis:
    return fakeredis.FakeRedis()


def _run(client: redis.Redis, engine: LlamaCppEngine | NumpyReferenceEngine,
         sessions: dict[str, tuple[list[int], int, Sampling, tuple[int, ...]]]) -> Honest:
    for slot in range(engine.capacity.n_slots):
        engine.release(slot)
    client.flushall()
    worker = make_worker(client, engine)
    h = Honest(client, worker)
    for sid, (prompt, n, sampling, stop) in sessions.items():
        h.open(sid, prompt, n, sampling=sampling, stop_tokens=stop)
    h.run(list(sessions))
    worker.sampler.close()
    return h


CONTROLS = {
    "logprobs": Sampling(logprobs=3),
    "sampled-logprobs": Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=7, logprobs=2),
    "penalties": Sampling(temperature=0.8, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                          frequency_penalty=0.3, penalty_last_n=16, seed=3),
    "bias": Sampling(logit_bias=((60, 5.0), (61, -100.0)), banned_token_ids=(62,), min_tokens=3),
    "json": Sampling(json_schema=SCHEMA, temperature=0.7, seed=11),
}


def test_every_control_alone_equals_batched_with_its_logprobs(client: redis.Redis, engine: LlamaCppEngine) -> None:
    sessions = {name: ([BOS, 30 + i, 40 + i], 12, s, (EOS,)) for i, (name, s) in enumerate(CONTROLS.items())}
    alone = {sid: _run(client, engine, {sid: spec}).results[sid] for sid, spec in sessions.items()}
    batched = _run(client, engine, sessions).results
    for sid in sessions:
        assert [(r.token, r.logprobs, r.status, r.finished) for r in batched[sid]] == \
               [(r.token, r.logprobs, r.status, r.finished) for r in alone[sid]], sid
    for r in batched["logprobs"]:
        assert r.token is not None and r.logprobs is not None and len(r.logprobs.top) == 3
        # greedy: the chosen token is the most likely one, and its log-probability is the top one
        assert r.logprobs.top[0] == (r.token, r.logprobs.lp) and r.logprobs.lp <= 0
        assert [lp for _i, lp in r.logprobs.top] == sorted((lp for _i, lp in r.logprobs.top), reverse=True)
    assert all(r.logprobs is not None and len(r.logprobs.top) == 2 for r in batched["sampled-logprobs"])
    assert all(r.logprobs is None for r in batched["penalties"])  # not asked: not sent
    for sid in sessions:
        assert BOS not in [r.token for r in batched[sid]]  # special: never sampled unless allowed
    assert 61 not in [r.token for r in batched["bias"]] and 62 not in [r.token for r in batched["bias"]]


def test_a_json_schema_session_produces_json(client: redis.Redis, engine: LlamaCppEngine, tok: Tokenizer) -> None:
    h = _run(client, engine, {f"j{i}": ([BOS, 50 + i], 40, Sampling(json_schema=SCHEMA, temperature=0.8, seed=i),
                                        (EOS,)) for i in range(3)})
    done = 0
    for sid, rs in h.results.items():
        assert all(r.status == Status.OK for r in rs), rs[-1]
        toks = [r.token for r in rs if r.token is not None]
        if rs[-1].finished and toks and toks[-1] == EOS:
            assert isinstance(json.loads(tok.decode(toks[:-1]))["a"], int), sid
            done += 1
    assert done >= 1


def test_a_complete_grammar_ends_the_session_with_an_ok_answer(client: redis.Redis, engine: LlamaCppEngine,
                                                               tok: Tokenizer) -> None:
    # "ab", then only the end of generation, which the session bans: nothing more is admissible
    h = _run(client, engine, {"g": ([BOS, 60], 10, Sampling(grammar='root ::= "ab"', banned_token_ids=(EOS,)), ())})
    rs = h.results["g"]
    assert tok.decode([r.token for r in rs if r.token is not None]) == "ab"
    last = rs[-1]
    assert last.status == Status.OK and last.finished and last.token is None and "grammar" in last.detail


def test_grammars_the_worker_cannot_run_are_refused_at_the_opening(client: redis.Redis, engine: LlamaCppEngine,
                                                                   tiny_model_path: Path) -> None:
    h = _run(client, engine, {"bad": ([BOS, 60], 4, Sampling(grammar="root ::= nowhere"), ())})
    (r,) = h.results["bad"]
    assert (r.status, r.reason) == (Status.REJECTED, Reason.GRAMMAR_INVALID)
    assert engine.capacity.n_slots == 8 and not h.worker.scheduler.table.busy_slots  # no slot was taken
    ref = NumpyReferenceEngine(tiny_model_path, n_slots=2, ctx_per_session=64)
    h = _run(client, ref, {"u": ([1, 2], 4, Sampling(grammar='root ::= "a"'), ())})
    (r,) = h.results["u"]
    assert (r.status, r.reason) == (Status.REJECTED, Reason.GRAMMAR_UNSUPPORTED)


def test_a_row_with_no_token_left_ends_its_session_alone(client: redis.Redis, engine: LlamaCppEngine) -> None:
    # the only allowed id is special (never sampled unless the session allows it): nothing is left
    h = _run(client, engine, {"none": ([BOS, 60], 5, Sampling(allowed_token_ids=(BOS,)), ()),
                              "fine": ([BOS, 61], 5, Sampling(), ())})
    (r,) = h.results["none"]
    assert (r.status, r.reason) == (Status.FAILED, Reason.NO_TOKEN)
    assert len(h.results["fine"]) == 5 and h.results["fine"][-1].finished
    ok = _run(client, engine, {"allowed": ([BOS, 60], 3, Sampling(allowed_token_ids=(BOS,), allow_special=True), ())})
    assert [r.token for r in ok.results["allowed"]] == [BOS] * 3
