"""The batching worker: the loop (loop.py) over the transport, the scheduler, the engine and the sampler;
one lane per engine (lane.py: a worker may serve several), a fused call and its retries (calls.py), the
delivery rules (delivery.py), entry admission (admission.py), the I/O thread (io_thread.py), route hops'
activations (hop_steps.py), idle sessions (idle.py)."""

from ..config import WorkerSettings
from .loop import Worker
from .stats import LoopStats

__all__ = ["LoopStats", "Worker", "WorkerSettings"]
