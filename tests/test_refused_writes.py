"""A Redis that refuses writes for now (schemas/retry.py): at its maxmemory under noeviction (OOM), unable to
persist (MISCONF: a full disk, an RDB or AOF write error), short of replicas (NOREPLICAS). Every such refusal, of a
command, a script or a pipeline's command (redis-py's `Command # N (...) of pipeline caused error: ...`), is an
outage to ride through, not an error; what it refused did not happen; reads still go through. The service riding
through two of them mid-run: tests/test_chaos.py::test_redis_refusing_writes_mid_run."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from dgrtools.localredis import LocalRedis, free_port
from schemas.retry import transient


def _refusing(kind: str, srv: LocalRedis, client: redis.Redis) -> Callable[[], None]:
    """Make the server refuse writes; the function that makes it take them again."""
    if kind == "oom":
        client.config_set("maxmemory", "1")
        return lambda: client.config_set("maxmemory", "0") and None
    if kind == "noreplicas":
        client.config_set("min-replicas-to-write", "1")
        return lambda: client.config_set("min-replicas-to-write", "0") and None
    shutil.rmtree(srv.data_dir)  # misconf: its next snapshot fails, and with a save point it stops writes
    client.bgsave()
    deadline = time.monotonic() + 10
    while client.info("persistence")["rdb_last_bgsave_status"] != "err":
        assert time.monotonic() < deadline, "the snapshot did not fail"
        time.sleep(0.05)

    # its working directory is gone for good (a new one at that path is another): writes come back when the
    # operator lets it take them while it cannot persist
    return lambda: client.config_set("stop-writes-on-bgsave-error", "no") and None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalRedis]:
    with LocalRedis(port=free_port(), data_dir=tmp_path / "r", appendonly=False,
                    extra_args=("--save", "3600 1")) as srv:
        yield srv


@pytest.mark.parametrize("kind", ["oom", "misconf", "noreplicas"])
def test_a_refused_write_is_an_outage_and_did_not_happen(server: LocalRedis, kind: str) -> None:
    client = redis.Redis.from_url(server.url)
    client.set("k", "before")
    back = _refusing(kind, server, client)
    try:
        for write in (lambda: client.set("k", "after"),
                      lambda: client.eval("return redis.call('SET', KEYS[1], 'after')", 1, "k"),
                      lambda: client.pipeline(transaction=True).set("k", "after").xadd("s", {"a": 1}).execute(),
                      lambda: client.pipeline(transaction=False).get("k").set("k", "after").execute()):
            with pytest.raises(redis.ResponseError) as e:
                write()
            assert transient(e.value), e.value
        assert client.get("k") == b"before" and not client.exists("s")  # nothing refused happened; reads go on
    finally:
        back()
    client.set("k", "after")
    assert client.get("k") == b"after"


def test_a_wrong_command_is_not_an_outage(server: LocalRedis) -> None:
    client = redis.Redis.from_url(server.url)
    client.set("k", "v")
    for wrong in (lambda: client.xadd("k", {"a": 1}),  # WRONGTYPE
                  lambda: client.pipeline(transaction=False).set("j", 1).xadd("k", {"a": 1}).execute(),
                  lambda: client.eval("return redis.call('NOSUCH')", 0)):
        with pytest.raises(redis.ResponseError) as e:
            wrong()
        assert not transient(e.value), e.value
