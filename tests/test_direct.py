"""The transport's kept connection (consumer/transport/connection.py `Direct`): the read ahead's and the scripts'
requests without redis-py's per-request wrapper, on a real redis-server. Raw replies, an error reply in its
place, a connection lost and made again through the pool, a stop that cuts it off; and the same replies through
`RedisIO.script` as through the client (a Sentinel failover: tests/test_failover.py)."""

from __future__ import annotations

import gc
import itertools
import threading
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.transport import RedisTransport
from consumer.transport.connection import Direct
from consumer.transport.unblock import cut_off
from dgrtools.localredis import LocalRedis
from producer import commands as c
from producer.tracker import execute


def test_raw_replies_and_an_error_in_its_place(real_redis: redis.Redis) -> None:
    d = Direct(real_redis)
    real_redis.set("dx", "1")
    got = d(("GET", "dx"), ("HGET", "dx", "f"), ("INCR", "dy"))
    assert got[0] == b"1" and isinstance(got[1], redis.ResponseError) and "WRONGTYPE" in str(got[1])
    assert got[2] == 1
    assert d(("GET", "dx")) == [b"1"]  # the connection goes on after an error reply


def test_a_lost_connection_is_raised_then_made_again_from_the_pool(real_redis: redis.Redis) -> None:
    d = Direct(real_redis)
    assert d(("PING",)) == [b"PONG"]
    pool = real_redis.connection_pool
    (kept,) = [c for c in pool._in_use_connections]  # kept between requests, where a stop finds it (unblock.py)
    real_redis.client_kill_filter(_type="normal", skipme=True)  # every other client's connection closed
    try:
        d(("GET", "dx"))
        raise AssertionError("a request on a closed connection answered")
    except redis.ConnectionError:
        pass
    assert kept not in pool._in_use_connections  # dropped, back to the pool
    assert d(("SET", "dz", "2")) == [b"OK"]
    assert real_redis.get("dz") == b"2"


def test_a_stop_cuts_the_kept_connection_off(real_redis: redis.Redis) -> None:
    d = Direct(real_redis)
    d(("PING",))
    assert cut_off(real_redis) == 1
    try:
        d(("PING",))
        raise AssertionError("a request on a cut-off connection answered")
    except redis.ConnectionError:
        pass
    d(("PING",))  # and made again


def test_scripts_answer_the_same_through_it_and_after_redis_lost_them(redis_server: LocalRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    t = RedisTransport(client, "wd", "c1")
    t.io.scripts["echo"] = client.register_script("return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}")
    assert t.io.direct() is not None
    via_direct = t.io.script("echo", ["k"], ["a", 41])
    client.script_flush()  # a restarted Redis has no scripts: NOSCRIPT, loaded again
    again = t.io.script("echo", ["k"], ["a", 41])
    kept, t.io._direct = t.io._direct, None
    via_client = t.io.script("echo", ["k"], ["a", 41])
    assert via_direct == again == via_client == [b"k", b"a", 42]
    t.io._direct = kept
    other = redis.Redis.from_url(redis_server.url)
    t.io.client = other  # another client in the transport's place (tests put a flaky one): not the kept one
    assert t.io.direct() is None


def test_a_kept_connection_goes_back_when_its_thread_ends_or_its_sender_goes(real_redis: redis.Redis) -> None:
    """A worker's I/O thread that ends, or a transport dropped (a crashed worker in a test), leaves no connection
    held: hundreds of them would otherwise hold a socket each until Redis or the process runs out."""
    pool = real_redis.connection_pool
    before = set(pool._in_use_connections)
    d = Direct(real_redis)
    t = threading.Thread(target=d, args=(("PING",),))
    t.start()
    t.join()
    gc.collect()
    assert set(pool._in_use_connections) == before  # the thread ended: its connection is the pool's again
    d(("PING",))
    assert len(pool._in_use_connections) == len(before) + 1
    del d
    gc.collect()
    assert set(pool._in_use_connections) == before
    for _ in range(50):  # many senders made and dropped: the pool's connections are reused, not piled up
        Direct(real_redis)(("PING",))
    gc.collect()
    assert set(pool._in_use_connections) == before and len(pool._available_connections) <= 2


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_trackers_result_reads_are_the_clients(redis_server: LocalRedis, protocol: int) -> None:
    """The Tracker's lone XREAD (producer/tracker.py) on its kept connection reads what the client reads: several
    streams, a count, a block, nothing new; RESP2 and RESP3 replies alike."""
    client = redis.Redis.from_url(redis_server.url, protocol=protocol)
    direct = Direct(client)
    a, b = f"out:a:{protocol}", f"out:b:{protocol}"
    ids = [client.xadd(a, {"v": "2", "r": f"rec{i}", "c": "chg"}) for i in range(5)] + \
        [client.xadd(b, {"v": "2", "r": "other"})]
    last = ids[4].decode()
    for streams, limit, block in ((((a, "0-0"), (b, "0-0")), 64, None), (((a, "0-0"),), 2, 5),
                                  (((a, last), (b, ids[5].decode())), 8, 5), (((a, ids[1].decode()),), 64, None)):
        req = c.Read((c.XRead(streams=streams, limit=limit, block_ms=block),))
        assert execute(client, req, None, direct) == execute(client, req, None, None)


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_trackers_pushes_write_what_the_clients_write(redis_server: LocalRedis, protocol: int) -> None:
    """A batch of XADDs outside MULTI (a loop turn's pushes) on the kept connection writes the entries the client's
    pipeline writes: the same fields, in order, each stream trimmed to its bound; an error raised the same."""
    client = redis.Redis.from_url(redis_server.url, protocol=protocol)
    direct = Direct(client)
    written = {}
    for way in ("client", "kept"):
        a, b = f"in:a:{way}:{protocol}", f"in:b:{way}:{protocol}"
        # a bounded (MAXLEN ~ 5: trimmed by whole nodes of 100 entries) and b not
        ops = tuple(c.XAdd(a, {"v": "2", "j": f"job{i}"}, 5) if i % 3 else c.XAdd(b, {"v": "2", "j": f"job{i}"})
                    for i in range(450))
        assert execute(client, c.Batch(ops=list(ops)), None, direct if way == "kept" else None) is None
        written[way] = [[f for _, f in client.xrange(s)] for s in (a, b)]
        client.set(f"str:{way}:{protocol}", "x")
        bad = c.Batch(ops=[c.XAdd(f"ok:{way}:{protocol}", {"v": "2"}), c.XAdd(f"str:{way}:{protocol}", {"v": "2"})])
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            execute(client, bad, None, direct if way == "kept" else None)
    assert written["kept"] == written["client"] and written["client"][1][0] == {b"v": b"2", b"j": b"job0"}
    assert len(written["client"][0]) < 300 and len(written["client"][1]) == 150  # a was trimmed, b was not


_field = st.binary(min_size=0, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.lists(st.tuples(_field, _field), min_size=1, max_size=6), min_size=0, max_size=12),
       limit=st.integers(1, 20), start=st.integers(0, 12), protocol=st.sampled_from([2, 3]))
def test_any_bytes_read_by_the_tracker_read_the_same_both_ways(redis_server: LocalRedis, entries: list[Any],
                                                               limit: int, start: int, protocol: int) -> None:
    """Random bytes in result streams (field names and values of any bytes, repeated names, empty ones), read from
    a drawn entry on with a drawn count: the kept connection's raw reply reads as the client's parsed one."""
    client = redis.Redis.from_url(redis_server.url, protocol=protocol)
    stream = f"out:hostile:{next(_streams)}"
    ids = [client.execute_command("XADD", stream, "*", *[x for kv in fields for x in kv]) for fields in entries]
    after = ids[start - 1].decode() if 0 < start <= len(ids) else "0-0"
    req = c.Read((c.XRead(streams=((stream, after), (f"{stream}:none", "0-0")), limit=limit),))
    assert execute(client, req, None, Direct(client)) == execute(client, req, None, None)


_streams = itertools.count()
