"""The HMAC opt-in: a writer without the key cannot cancel, steer or bill a session (docs/security.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from consumer.engines.reference import NumpyReferenceEngine
from producer import Producer
from schemas import RouteHop, SessionSpec, Signer, StepJob, WorkerKeys, cancel_to_fields, job_to_fields

from .hostile_support import WID, Honest, dead_letters, make_worker
from .support import prompts, solo_generate

KEY = b"k" * 32
SIGNER = Signer([KEY])


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=256)
    yield eng
    eng.close()


def test_signatures_bind_fields_and_stream() -> None:
    fields = {"session_id": "s-1"}
    signed = {k.encode(): v.encode() for k, v in SIGNER.signed("dgr:{w}:cancel", fields).items()}
    assert SIGNER.verify("dgr:{w}:cancel", signed)
    assert not SIGNER.verify("dgr:{w2}:cancel", signed)  # another worker's stream
    assert not SIGNER.verify("dgr:{w}:cancel", {**signed, b"session_id": b"s-2"})  # another session
    assert not SIGNER.verify("dgr:{w}:cancel", {**signed, b"extra": b""})  # a field added
    assert not SIGNER.verify("dgr:{w}:cancel", {b"session_id": b"s-1"})  # none
    assert not Signer([b"o" * 32]).verify("dgr:{w}:cancel", signed)  # another key
    # rotation: a signer holding the new key first still accepts the old key's signatures
    assert Signer([b"n" * 32, KEY]).verify("dgr:{w}:cancel", signed)
    with pytest.raises(ValueError):
        Signer([b"short"])


def test_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_bytes(b"# rotation: the new key first\n" + b"n" * 40 + b"\n\n" + KEY + b"\n")
    s = Signer.from_file(path)
    signed = {k.encode(): v.encode() for k, v in Signer([KEY]).signed("x", {"a": "1"}).items()}
    assert s.verify("x", signed)
    path.write_bytes(b"# nothing\n")
    with pytest.raises(ValueError):
        Signer.from_file(path)


def test_forged_entries_are_dead_lettered_and_honest_sessions_unaffected(
        redis_client: redis.Redis, engine: NumpyReferenceEngine) -> None:
    worker = make_worker(redis_client, engine, signer=SIGNER)
    h = Honest(redis_client, worker, signer=SIGNER)
    ps = prompts(2, 300, seed=21)
    h.open("honest-0", ps[0], 5)
    h.open("honest-1", ps[1], 5)
    worker.run_once()
    h.poll()
    keys = WorkerKeys(WID)
    pre = keys.input_stream(worker.keys["prefill"].digest, "prefill")
    dec = keys.input_stream(worker.keys["decode"].digest, "decode")
    # a forger who knows the session ids and the (predictable) next job ids, but not the key
    forged_cancel = redis_client.xadd(keys.cancellations, cancel_to_fields("honest-0")).decode()
    next_job = StepJob(job_id=f"honest-j{next(h.ids) + 50}", session_id="honest-1", phase="decode",
                       compat=worker.keys["decode"].digest, start_position=h.position["honest-1"], tokens=(7,),
                       created_at=time.time())
    forged_steer = redis_client.xadd(dec, job_to_fields(next_job)).decode()  # type: ignore[arg-type]
    wrong_key = Signer([b"z" * 32]).signed(dec, job_to_fields(next_job))
    forged_wrong_key = redis_client.xadd(dec, wrong_key).decode()  # type: ignore[arg-type]
    spec = SessionSpec(session_id="billed", account_id="victim-acct",
                       route=(RouteHop(worker_id=WID, key=worker.keys["prefill"]),))
    forged_open = redis_client.xadd(pre, job_to_fields(StepJob(  # type: ignore[arg-type]
        job_id="b-0", session_id="billed", phase="prefill", compat=worker.keys["prefill"].digest,
        start_position=0, tokens=(1, 2, 3), created_at=time.time(), session=spec))).decode()
    # a signed entry moved to another stream (here: a cancel signed for another worker)
    moved = SIGNER.signed(WorkerKeys("other").cancellations, cancel_to_fields("honest-1"))
    forged_moved = redis_client.xadd(keys.cancellations, moved).decode()  # type: ignore[arg-type]
    h.run(["honest-0", "honest-1"])
    assert h.tokens["honest-0"] == solo_generate(engine, ps[0], 5)
    assert h.tokens["honest-1"] == solo_generate(engine, ps[1], 5)
    dlq = {d[b"entry_id"].decode(): d[b"reason"].decode() for d in dead_letters(redis_client)}
    assert dlq == dict.fromkeys([forged_cancel, forged_steer, forged_wrong_key, forged_open, forged_moved],
                                "bad_signature")
    # never answered: nothing written for the sessions or job ids the forger named, nothing billed
    assert not redis_client.exists(keys.result_record(next_job.job_id), keys.results("billed"),
                                   keys.billing_account("victim-acct"))


def test_the_producer_signs_what_it_writes(redis_client: redis.Redis, engine: NumpyReferenceEngine) -> None:
    worker = make_worker(redis_client, engine, signer=SIGNER)
    key = worker.keys["prefill"]
    producer = Producer(redis_client, signer=SIGNER, timeout_s=20)
    spec = SessionSpec(session_id="p-0", account_id="a", route=(RouteHop(worker_id=WID, key=key),), max_tokens=3)
    h = producer.open(spec, [5, 6, 7])
    for _ in range(30):
        worker.run_once()
        producer.read_results([h], block_ms=0)
        if h.finished:
            break
        if h.pending_job is None and h.generated:
            producer.push_decode(h, h.generated[-1])
    assert h.status == "finished" and len(h.generated) == 3
    spec2 = SessionSpec(session_id="p-1", account_id="a", route=(RouteHop(worker_id=WID, key=key),), max_tokens=50)
    h2 = producer.open(spec2, [5, 6, 7])
    worker.run_once()
    producer.cancel(WID, "p-1")
    worker.run_once()
    assert "p-1" not in worker.scheduler.table and h2.session_id == "p-1"
    assert dead_letters(redis_client) == []
