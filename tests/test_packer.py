"""consumer/packer.py: the commands' bytes in one C call are redis-py's own, for any arguments (or the same error),
and `connect()` gives its clients the packer only where their encoding is the packer's."""

from __future__ import annotations

import enum
from typing import Any

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.connect import RedisTarget, connect
from consumer.packer import OneCallPacker, packer_kwargs
from tests.fixtures.redis_server import LocalRedis


class _Code(enum.IntEnum):
    ONE = 1


class _Name(str):
    pass


_ARGS = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=())),  # lone surrogates too: both refuse to encode them
    st.binary(), st.integers(), st.integers(-(2 ** 80), 2 ** 80), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.binary().map(bytearray), st.binary().map(memoryview), st.just(_Code.ONE),
    st.text().map(_Name), st.lists(st.integers(), max_size=2),
)
_NAMES = st.sampled_from(["EVALSHA", "XADD", "set", "CLIENT SETNAME", "SCRIPT LOAD", b"GET", b"CONFIG GET", "É", "A\tB",
                          _Name("GET"), "X1"])


def _outcome(pack: Any, args: tuple[Any, ...]) -> tuple[str, bytes]:
    try:
        return "ok", b"".join(bytes(part) for part in pack(*args))
    except Exception as e:  # the error's kind is the outcome: redis-py's DataError, an encoding error
        return type(e).__name__, b""


@settings(max_examples=600, deadline=None)
@given(_NAMES, st.lists(_ARGS, max_size=8))
def test_the_packer_packs_as_redis_py_does(name: Any, args: list[Any]) -> None:
    command = (name, *args)
    assert _outcome(OneCallPacker().pack, command) == _outcome(redis.Connection().pack_command, command)


def test_a_completion_call_is_packed_in_one_call() -> None:
    """The worker's completion call (a one-word name, str keys, int and bytes arguments) takes the one C call."""
    keys = [f"dgr:{{w}}:acct:session:s{i}" for i in range(256)]
    command = ("EVALSHA", "f" * 40, len(keys), *keys, "g", 60, b'{"records":[]}', 1.5)
    packed = OneCallPacker().pack(*command)
    assert len(packed) == 1 and packed[0] == b"".join(redis.Connection().pack_command(*command))


def test_clients_get_the_packer_only_with_its_encoding(redis_server: LocalRedis) -> None:
    def packer(client: Any) -> Any:
        return client.connection_pool.connection_kwargs.get("command_packer")

    plain = connect(RedisTarget(url=redis_server.url))
    assert isinstance(packer(plain), OneCallPacker)
    script = plain.register_script("return {KEYS[1], ARGV[1], ARGV[2]}")
    assert script(keys=["k"], args=["é", 7]) == [b"k", "é".encode(), b"7"]  # through the packer, on a real server
    plain.set("k", b"v")
    assert plain.client_setname("dgr-packer") and plain.get("k") == b"v"  # a two-word command: redis-py's packer
    assert packer(connect(RedisTarget(url=redis_server.url + "?encoding=latin-1"))) is None
    assert packer(connect(RedisTarget(url=redis_server.url), encoding="latin-1")) is None
    assert packer(connect(RedisTarget(url=redis_server.url), encoding_errors="replace")) is None
    mine = OneCallPacker()
    assert packer_kwargs({"command_packer": mine})["command_packer"] is mine
    assert packer_kwargs({"encoding": "UTF_8"}, {"db": 1})["command_packer"] is not None
    plain.delete("k")
    plain.close()
