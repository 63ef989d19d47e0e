"""A consumer process for `dgr bench fleet`: the real Worker (consumer/worker) over a sleep engine whose fused
call also costs a fixed time per row, so that a prompt's prefill costs in proportion to the tokens computed and
a prefix-cache hit (restored, not computed) is visibly cheaper; run as
`python -m dgrtools.bench.fleet_worker --redis-url URL --worker-id W ...` (kill -9 kills a whole worker).

The tokens stay those of consumer/engines/sleep.py (a hash of position and input token): batch-invariant, and
a restore has nothing to restore (`save_prefix` stores a marker), so a moved or cached session's tokens equal
its solo run's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import numpy.typing as npt

from consumer.batch import FusedBatch
from consumer.engines.sleep import SleepEngine

__all__ = ["PrefillSleepEngine", "main"]


class PrefillSleepEngine(SleepEngine):
    """Sleeps `step_s + row_s x rows` per fused call; supports the prefix cache (docs/prefix-cache.md)."""

    def __init__(self, step_s: float, row_s: float, state_bytes: int = 0, invariant: bool = True, **kw: int) -> None:
        super().__init__(step_s, **kw)
        self.row_s = row_s
        self.state = b"\0" * state_bytes if state_bytes > 0 else b"sleep"
        # Its tokens are exact in any shape; `invariant` False makes it say otherwise, as a `fast` llama.cpp engine
        # does, so that the worker replays as it would there (SchedulerConfig.exact_replay)
        self.recipe = self.recipe.model_copy(update={"batch_invariant": invariant})

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        t_end = time.perf_counter() + self.row_s * len(batch)
        rows = super().step(batch)
        left = t_end - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return rows

    def prefix_unsupported(self) -> str | None:
        return None

    def prefix_floor(self, slot: int) -> int:
        return 0

    def save_prefix(self, slot: int) -> bytes:
        # The logits depend on (position, token) alone: nothing to keep but the size a real state would take.
        return self.state

    def restore_prefix(self, slot: int, data: bytes, n_tokens: int) -> None:
        pass

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "row_s": f"{self.row_s:g}"}


def main(argv: list[str] | None = None) -> None:
    import redis

    from consumer.engines.engine_set import EngineSet
    from consumer.transport import RedisTransport
    from consumer.worker import Worker, WorkerSettings

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--row-us", type=float, default=50.0)
    ap.add_argument("--heartbeat-s", type=float, default=0.25)
    ap.add_argument("--cache-bytes", type=int, default=1 << 20)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--state-bytes", type=int, default=0, help="Bytes a saved prefix takes (0: 5).")
    ap.add_argument("--not-invariant", action="store_true", help="Say the recipe is not batch-invariant (fast).")
    a = ap.parse_args(argv)
    engine = PrefillSleepEngine(a.step_ms * 1e-3, a.row_us * 1e-6, a.state_bytes, invariant=not a.not_invariant,
                                n_slots=a.slots, ctx_per_session=a.ctx)
    client = redis.Redis.from_url(a.redis_url, socket_connect_timeout=5, socket_timeout=30)
    settings = WorkerSettings(worker_id=a.worker_id, max_batch=a.slots, heartbeat_s=a.heartbeat_s,
                              prefix_cache_bytes=a.cache_bytes, overlap=False)
    worker = Worker(EngineSet({"sleep": engine}), RedisTransport(client, a.worker_id, a.worker_id), settings)
    worker.install_signal_handlers()
    worker.run()


if __name__ == "__main__":
    main()
