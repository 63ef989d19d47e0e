"""The pure scheduling core (vLLM v1's `sched/`): admission, phase queues with weighted round-robin,
chunked prefill, and the output processor that turns a fused call's sampled tokens into answers. No
I/O, no clock, no engine, no sampling arithmetic, no wire model (tests/test_layering.py)."""

from .config import SchedulerConfig
from .outputs import Answer, AnswerClose, BatchItem, Outcome, ScheduledBatch, SchedulerStats
from .pacing import PrefillPacer
from .scheduler import Scheduler
from .session_table import ClosedSession, CloseKind, SessionEntry, SessionState, SessionTable

__all__ = [
    "Answer", "AnswerClose", "BatchItem", "CloseKind", "ClosedSession", "Outcome", "PrefillPacer", "ScheduledBatch",
    "Scheduler", "SchedulerConfig", "SchedulerStats", "SessionEntry", "SessionState", "SessionTable",
]
