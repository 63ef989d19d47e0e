"""Dead letters: list, replay at most once with an audit record, never outside the worker's streams."""

from __future__ import annotations

import threading

import redis

from consumer.ops.common import OpsKeys, s
from consumer.ops.deadletters import audit_log, dead_letter_count, list_dead_letters, replay
from consumer.ops.jobs import dlq_count_job
from dgrtools.localredis import LocalRedis
from schemas import job_from_fields, job_to_fields
from tests.test_ops_support import dead_letter, make_key, read_all, register, step_job


def test_list_shows_reason_stream_and_original_fields(redis_client: redis.Redis) -> None:
    t = register(redis_client, "w1")
    job = step_job("s1", 1)
    fields = {k: v for k, v in job_to_fields(job).items()}
    dlq_id = dead_letter(t, fields)
    register(redis_client, "w2")
    (d,) = list_dead_letters(redis_client)
    assert d.ref == f"w1/{dlq_id}" and d.reason == "incompatible" and d.detail == "bad compat"
    assert d.stream == t.keys.input_stream(make_key("decode").digest, "decode")
    assert d.fields == {k: str(v) for k, v in fields.items()} and d.replayed_as is None
    assert d.extra.get("consumer") == "w1-c"
    assert list_dead_letters(redis_client, reason="capacity") == []
    assert dead_letter_count(redis_client, "w1") == 1 and dead_letter_count(redis_client, "w2") == 0


def test_replay_once_into_the_original_stream_with_an_audit(redis_client: redis.Redis) -> None:
    t = register(redis_client, "w1")
    job = step_job("s1", 1)
    dlq_id = dead_letter(t, dict(job_to_fields(job)))
    stream = t.keys.input_stream(make_key("decode").digest, "decode")
    n0 = redis_client.xlen(stream)

    (res,) = replay(redis_client, "w1", [dlq_id], who="alice", note="fixed compat check")
    assert res.status == "replayed" and res.new_id
    assert redis_client.xlen(stream) == n0 + 1
    # The worker's consumer group delivers it like any new entry, with the original fields.
    (d,) = read_all(t)
    assert d.entry_id == res.new_id and job_from_fields(d.fields) == job
    (a,) = audit_log(redis_client, "w1")
    assert a["who"] == "alice" and a["dlq_id"] == dlq_id and a["new_id"] == res.new_id
    assert a["stream"] == stream and a["reason"] == "incompatible" and a["note"] == "fixed compat check"
    assert float(a["at"]) > 0
    assert s(redis_client.get(OpsKeys("w1").dlq_replayed(dlq_id))) == res.new_id

    # Twice: refused, nothing written.
    (again,) = replay(redis_client, "w1", [dlq_id], who="bob")
    assert again.status == "already" and again.new_id == res.new_id
    assert redis_client.xlen(stream) == n0 + 1 and len(audit_log(redis_client, "w1")) == 1
    (listed,) = list_dead_letters(redis_client, ["w1"])
    assert listed.replayed_as == res.new_id


def test_replay_refuses_missing_and_foreign_streams(redis_client: redis.Redis) -> None:
    t = register(redis_client, "w1")
    register(redis_client, "w2")
    assert replay(redis_client, "w1", ["9-9"], who="x")[0].status == "missing"
    # A dead letter whose `stream` names another worker's stream (or any other key) is never replayed.
    other = register(redis_client, "w2").keys.input_stream(make_key("decode").digest, "decode")
    forged = redis_client.xadd(t.keys.dead_letters, {"reason": "x", "stream": other, "entry_id": "1-0",
                                                     "f:v": "1"})
    n = redis_client.xlen(other)
    (res,) = replay(redis_client, "w1", [s(forged)], who="x")
    assert res.status == "invalid" and redis_client.xlen(other) == n
    forged2 = redis_client.xadd(t.keys.dead_letters, {"reason": "x", "stream": "dgr:{w1}:spec", "f:v": "1"})
    assert replay(redis_client, "w1", [s(forged2)], who="x")[0].status == "invalid"
    own = t.keys.input_stream(make_key("decode").digest, "decode")
    empty = redis_client.xadd(t.keys.dead_letters, {"reason": "x", "stream": own, "entry_id": "1-0"})
    assert replay(redis_client, "w1", [s(empty)], who="x")[0].status == "empty"


def test_concurrent_replays_write_once(real_redis: redis.Redis, redis_server: LocalRedis) -> None:
    t = register(real_redis, "w1")
    dlq_id = dead_letter(t, dict(job_to_fields(step_job("s1", 1))))
    stream = t.keys.input_stream(make_key("decode").digest, "decode")
    n0 = real_redis.xlen(stream)
    results: list[str] = []

    def go(i: int) -> None:
        c = redis.Redis.from_url(redis_server.url)
        results.append(replay(c, "w1", [dlq_id], who=f"op{i}")[0].status)
        c.close()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(results) == ["already"] * 7 + ["replayed"]
    assert real_redis.xlen(stream) == n0 + 1 and real_redis.xlen(OpsKeys("w1").dlq_audit) == 1
    assert dlq_count_job(redis_server.url) == {"w1": 1}
