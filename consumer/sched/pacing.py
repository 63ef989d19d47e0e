"""Sizing prefill calls in seconds rather than tokens.

Phase is part of compatibility, so a prefill chunk never rides in a decode call; while it runs, every
decoding session waits. A fixed token budget (Sarathi-Serve's knob) is right for one model on one
machine only: 512 tokens of Gemma on two CPU cores take ~1.5 s, twenty times a decode step. The pacer
keeps a prefill call at about `ratio` times the current decode call, so with at most one prefill call
between two decode calls (the default weights) a decoding session's inter-token time grows by at most
that ratio. It learns both costs online (EMA) and converges whatever the fixed cost of a call is:
with call(k) = f + c*k and budget k' = ratio*d / (call(k)/k), the fixed point is call(k*) = ratio*d.
With nothing decoding it returns the burst (`idle_tokens`, the worker's `--prefill-burst`, default 2,048
like llama-server's batch, capped by the engine's n_batch): no session waits for the call, so it takes as
many prompt tokens as the engine runs in one call, and a wave of prompts pays one call's Python, read
and filing per 2,048 tokens instead of per 512. With any session decoding the call stays within the
configured budget B (the decode bound of consumer/sched/scheduler.py counts B) and is paced as above.

Time to first token is bounded in fused calls: the budget never drops below `min_tokens` (F, the
worker's `--prefill-floor`, default 32, capped by the configured budget B). Prefill is served at least
once in every w_decode + w_prefill calls while it has work, every other prefill call is FIFO by admission
(the others take the fewest prompt rows left first: consumer/sched/batching.py), and a call takes at
least F - 1 prompt tokens (the shape rule of consumer/sched/prefill_shape.py may hold one back). So a
prompt of L tokens with Q prompt tokens admitted before it gets its first token within
2 * (w_decode + w_prefill) * ceil((Q + L) / (min(F, B) - 1)) fused calls, whatever the decode load, and
within half that when no other prompt waits (tests/test_worker_inprocess.py counts the second,
tests/test_scheduler.py the first in prefill calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import Phase


@dataclass
class PrefillPacer:
    max_tokens: int  # the configured budget: never exceeded while a session decodes
    idle_tokens: int = 0  # the burst: the budget while nothing decodes (<= max_tokens: max_tokens)
    ratio: float = 0.8  # target prefill call time / decode call time; <= 0: fixed budget
    min_tokens: int = 32  # the floor: see the module docstring
    alpha: float = 0.3  # EMA weight of the newest observation
    decode_s: float | None = None  # EMA of a decode call's seconds
    prefill_s_per_token: float | None = None  # EMA of a prefill call's seconds per token

    def observe(self, phase: Phase, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if phase == "decode":
            self.decode_s = self._ema(self.decode_s, seconds)
        else:
            self.prefill_s_per_token = self._ema(self.prefill_s_per_token, seconds / tokens)

    def budget(self, decoding: bool, decode_s: float | None = None) -> int:
        """`decode_s`: pace against this decode call time instead of this pacer's own (a worker of several
        engines: the decoding sessions that wait for this prefill call may be another engine's)."""
        if not decoding:
            return max(self.max_tokens, self.idle_tokens)
        decode_s = self.decode_s if decode_s is None else decode_s
        if self.ratio <= 0 or decode_s is None or self.prefill_s_per_token is None:
            return self.max_tokens
        tokens = int(self.ratio * decode_s / self.prefill_s_per_token)
        return max(min(self.min_tokens, self.max_tokens), min(self.max_tokens, tokens))

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
