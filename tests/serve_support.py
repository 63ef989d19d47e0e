"""What the `dgr serve` tests share: the tiny-model worker they serve from."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import redis

from dgrtools.process import ConsumerProcess


def tiny_worker(redis_url: str, worker_id: str, model_path: Path, logs: Path, *, slots: int,
                extra: Sequence[str] = ()) -> ConsumerProcess:
    """A consumer of the tiny model on one thread, started when entered. GGML_CPU_TILED_MM=0 as the invariant
    recipe sets it before ggml's first K-quant matmul: its rows are then the same whatever the batch."""
    return ConsumerProcess(redis_url, worker_id, f"tiny={model_path}", logs, slots=slots, threads=1,
                           extra=list(extra), env={"GGML_CPU_TILED_MM": "0"})


@contextmanager
def serving_alone(redis_url: str, worker_id: str, model_path: Path, logs: Path, *, slots: int
                  ) -> Iterator[redis.Redis]:
    """Redis emptied, then one tiny worker on it: a client of that Redis while the worker serves (a test
    module's one worker, whose session records it counts)."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    with tiny_worker(redis_url, worker_id, model_path, logs, slots=slots):
        yield client
