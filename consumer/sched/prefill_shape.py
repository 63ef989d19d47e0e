"""How many prompt rows a session puts into one prefill call, so that its numbers stay its own.

llama.cpp computes a row with one kernel when its session has a single row in the micro-batch and with
another when it has two or more (llamafile's sgemm is skipped below two rows), and the two round
differently. So a position's logits, and the KV every later position reads, depend on whether that
position was computed alone or with others of its session (docs/invariance.md, measured on Gemma 3).
Which *two or more* rows share a call does not matter: any split into pieces of >= 2 rows gives the
same bits. Hence one rule, a function of the session's own positions only:

* a prompt position is computed in a piece of at least 2 rows of its session (a 1-token prompt excepted),
  so no split may leave a single prompt row for a later call;
* a position after the prompt (a replay re-sends the generated tokens as prefill) is computed in a piece
  of exactly 1 row, as it was when it was decoded (under a batch-invariant recipe only: elsewhere the
  scheduler passes the replay's end as the prompt's, SchedulerConfig.exact_replay).

The budget, the pacer, the producer's chunking and the other sessions in the call may cut a prompt
anywhere else. The engine keeps a session's rows of one call in one micro-batch (engines/llama.py).
"""

from __future__ import annotations

MIN_BUDGET = 3  # with >= 3 a prompt remainder of 3 can always go whole, so no prompt ever waits forever


def piece_rows(start: int, budget: int, queued_end: int, prompt_end: int | None) -> int:
    """Rows the session takes in the next prefill call; 0: not in this call.

    start: its next position; budget: the tokens the call has left; queued_end: the end of its queued
    prefill tokens that follow on from `start` (up to and including its first sampling job);
    prompt_end: where its prompt ends, None while unknown (the last prompt job is not queued yet and
    the SessionSpec does not say).
    """
    if queued_end <= start or budget <= 0:
        return 0
    if prompt_end is None:
        # The end is not here yet: keep one queued token back, so the rest of the prompt has >= 2 rows.
        n = min(budget, queued_end - start - 1)
        return n if n >= 2 else 0
    if start >= prompt_end:
        return 1  # a replayed generated token: alone, as when it was decoded
    left = prompt_end - start
    if left == 1:
        return 1  # a 1-token prompt (the rule never leaves a single row behind otherwise)
    n = min(budget, queued_end - start, left)
    if left - n == 1:
        n -= 1  # never leave one prompt row for a later call
    return n if n >= 2 else 0
