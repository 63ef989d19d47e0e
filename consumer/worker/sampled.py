"""From the sampler's answer for one fused call (`SampledCall`: per sampling row a token, a status and
log-probabilities) to the scheduler's report (docs/sampling.md):

* a row with a token advances its session, with its log-probabilities when the session asked;
* a row whose grammar admits no further token (its constrained output is complete) ends its session:
  an OK answer, finished, with no token;
* a row the sampler could not serve ends its session with a reason: every token masked (`no_token`), a
  grammar that does not compile here (`grammar_invalid`, `grammar_unsupported`: admission refuses those
  at the opening, so this is a backstop), or a session whose context the sampler has not seen (a
  `state_lost`: the Tracker replays it from position 0, which rebuilds the context).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from schemas import Reason, Status, TokenLogprobs

from ..sampler import RowStatus, SampledCall
from ..sched import Answer, ScheduledBatch, Scheduler
from ..sched.outputs import BatchItem

__all__ = ["apply_sampled", "logprobs_of"]

_ENDS: Final[dict[RowStatus, tuple[Status, Reason, str]]] = {
    RowStatus.NO_TOKEN: (Status.FAILED, Reason.NO_TOKEN, "no token left to sample after the session's masks"),
    RowStatus.GRAMMAR_INVALID: (Status.FAILED, Reason.GRAMMAR_INVALID, "the session's grammar does not compile"),
    RowStatus.GRAMMAR_UNSUPPORTED: (Status.FAILED, Reason.GRAMMAR_UNSUPPORTED,
                                    "this engine has no llama.cpp vocabulary: no grammars"),
    RowStatus.NO_CONTEXT: (Status.STATE_LOST, Reason.ENGINE_ERROR,
                           "the sampler has not seen the session's context: replay it"),
}


def logprobs_of(items: Sequence[BatchItem], sampled: SampledCall) -> list[TokenLogprobs | None] | None:
    """Per sampling item, its token's log-probabilities when its session asked (None: nobody asked)."""
    asked = [it.sampling.logprobs if it.sampling is not None else None for it in items]
    if asked.count(None) == len(asked):
        return None
    out: list[TokenLogprobs | None] = []
    for k, n in enumerate(asked):
        if n is None or sampled.tokens[k] < 0:
            out.append(None)
            continue
        ids = sampled.top_ids[k, :n].tolist()
        lps = sampled.top_logprobs[k, :n].tolist()
        top = tuple((i, lp) for i, lp in zip(ids, lps, strict=True) if i >= 0 and math.isfinite(lp))
        out.append(TokenLogprobs(lp=float(sampled.logprob[k]), top=top))
    return out


def apply_sampled(scheduler: Scheduler, batch: ScheduledBatch, sampled: SampledCall,
                  engine_seconds: float) -> list[Answer]:
    """The call's answers: `update_from_output` for the rows with a token (or a complete grammar), `fail`
    (with the row's reason) for the sessions of rows the sampler could not serve."""
    items = batch.sampling_items
    lps = logprobs_of(items, sampled)
    status = sampled.status
    if not status.any():  # the common case: every row has its token
        return scheduler.update_from_output(batch, sampled.tokens.tolist(), engine_seconds, logprobs=lps)
    ending: dict[RowStatus, set[str]] = {}
    complete: set[str] = set()
    for k, it in enumerate(items):
        st = RowStatus(int(status[k]))
        if st == RowStatus.GRAMMAR_END:
            complete.add(it.session_id)
        elif st != RowStatus.OK:
            ending.setdefault(st, set()).add(it.session_id)
    bad = set().union(*ending.values()) if ending else set()
    out: list[Answer] = []
    good = batch.without(bad) if bad else batch
    if good is not None:
        keep = [k for k, it in enumerate(items) if it.session_id not in bad]
        out += scheduler.update_from_output(
            good, [int(sampled.tokens[k]) for k in keep], engine_seconds,
            logprobs=[lps[k] for k in keep] if lps is not None else None,
            ended={j for j, k in enumerate(keep) if items[k].session_id in complete})
    for st, sids in ending.items():
        part = batch.without([s for s in batch.session_ids if s not in sids])
        if part is not None:
            st_, reason, detail = _ENDS[st]
            out += scheduler.fail(part, detail, status=st_, reason=reason)
    return out
