"""A replay that samples the session's tokens again (producer/steps.py `regenerates`), in the Tracker's sans-I/O
core: what it pushes, how it checks each token sampled again, what its caller sees, and when it re-feeds the
tokens as prompt instead. Answers are built here as a worker would write them (tests/test_delivery.py and
tests/test_continuation.py run the same through a worker)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from producer import ProducerCore, SessionHandle
from producer.commands import Batch, HSet, XAdd
from producer.session import known
from producer.steps import attempt_spec
from schemas import (
    BoundarySchema,
    CompatibilityKey,
    EngineIdentity,
    Reason,
    Recipe,
    RouteHop,
    SessionSpec,
    StateLayout,
    Status,
    StepJob,
    StepResult,
    job_from_fields,
)
from schemas.limits import MAX_GENERATE, MAX_POSITION

PROMPT = (5, 6, 7, 8)
HAD = [11, 12, 13]  # the tokens the session had when its state was lost


def _key(invariant: bool) -> CompatibilityKey:
    return CompatibilityKey(
        engine=EngineIdentity(architecture="t", gguf_sha256="0" * 64),
        recipe=Recipe(quantization="F32", kv_cache_type="f32", ctx_per_session=256, flash_attention=False,
                      batch_invariant=invariant, runtime="t"),
        phase="prefill",
        boundary=BoundarySchema(name="tokens->logits", version=1, consumes="tokens", produces="logits",
                                last_layer=1),
        state=StateLayout(kind="kv", dims={"n_layer": 1}),
    )


def _lost(invariant: bool = True, max_attempts: int = 3, had: list[int] = HAD, max_tokens: int = 8
          ) -> tuple[ProducerCore, SessionHandle]:
    """A one-hop session of max_tokens (one decode job per token) that had `had`, its state lost."""
    core = ProducerCore(verify_route=False, prefill_chunk=64, max_attempts=max_attempts)
    spec = SessionSpec(session_id="s1", account_id="a", route=(RouteHop(worker_id="w1", key=_key(invariant)),),
                       max_tokens=max_tokens)
    h = core.new_handle(spec, PROMPT, 0)
    h.credit.n = 1
    core.queue_prefill(Batch(), h)
    h.generated, h.status = list(had), "state_lost"
    return core, h


def _pushed(batch: Batch) -> list[StepJob]:
    return [job_from_fields(op.fields) for op in batch.ops if isinstance(op, XAdd)]


def _answer(h: SessionHandle, job: StepJob, token: int, finished: bool = False) -> StepResult:
    """The worker's OK answer to `job` with `token` (at the position after the job's rows)."""
    return StepResult(job_id=job.job_id, session_id=h.session_id, status=Status.OK, position=job.end_position,
                      worker_id="w1", token=token, finished=finished)


def _replay(core: ProducerCore, h: SessionHandle) -> list[StepJob]:
    b = Batch()
    core.advance(b, h, True)
    return _pushed(b)


def test_the_replay_sends_the_prompt_alone_and_each_token_sampled_again_is_checked_not_passed_on() -> None:
    core, h = _lost()
    (opening,) = _replay(core, h)
    assert opening.tokens == PROMPT and opening.attempt == 1
    assert opening.session is not None and opening.session.prompt_len == len(PROMPT)
    assert opening.session.max_tokens == 8  # the whole session's: its tokens are sampled again
    assert (h.regenerate, h.generated) == (HAD, [])
    job = opening
    for tok in HAD:  # sampled again, in order: placed, flagged as the caller's already
        assert core.apply(h, _answer(h, job, tok)) and h.echo
        (job,) = _replay(core, h)
        assert job.phase == "decode" and job.tokens == (tok,)  # it feeds the token it placed
    assert h.generated == HAD
    assert core.apply(h, _answer(h, job, 14)) and not h.echo  # past them: news
    assert h.generated == [*HAD, 14] and h.status == "open"


def test_the_record_says_so_and_keeps_every_token() -> None:
    core, h = _lost()
    b = Batch()
    core.advance(b, h, True)
    (record,) = [op for op in b.ops if isinstance(op, HSet)]
    assert record.mapping["gen"] == ",".join(map(str, HAD)) and record.mapping["regen"] == "1"


def test_a_token_sampled_otherwise_loses_the_attempt_and_the_next_replay_feeds_the_tokens() -> None:
    core, h = _lost()
    (opening,) = _replay(core, h)
    core.apply(h, _answer(h, opening, HAD[0]))
    (job,) = _replay(core, h)
    assert core.apply(h, _answer(h, job, 99))  # HAD[1] was sampled there before
    assert h.status == "state_lost" and h.diverged and "99" in h.detail
    assert h.generated == HAD  # what the caller had, not the attempt's prefix
    (again,) = _replay(core, h)
    assert again.attempt == 2 and again.tokens == (*PROMPT, *HAD) and not h.regenerate
    assert again.session is not None and again.session.prompt_len == len(PROMPT)
    assert again.session.max_tokens == 8 - len(HAD)


def _ended_one_in(status: Status, reason: Reason) -> tuple[ProducerCore, SessionHandle]:
    """A replay one token into the tokens it samples again, whose next job the worker answers `status`."""
    core, h = _lost()
    (opening,) = _replay(core, h)
    core.apply(h, _answer(h, opening, HAD[0]))
    (job,) = _replay(core, h)
    assert core.apply(h, StepResult(job_id=job.job_id, session_id=h.session_id, status=status,
                                    position=job.start_position, worker_id="w1", reason=reason))
    return core, h


def test_an_attempt_ended_amid_them_leaves_the_caller_every_token() -> None:
    _, h = _ended_one_in(Status.CANCELLED, Reason.CANCELLED)
    assert h.status == "cancelled" and h.generated == HAD and known(h) == HAD


def test_no_sampling_again_on_a_recipe_without_the_promise_nor_by_hand() -> None:
    core, h = _lost(invariant=False)
    (opening,) = _replay(core, h)
    assert opening.tokens == (*PROMPT, *HAD) and h.regenerate == [] and h.generated == HAD
    core, h = _lost()
    b = Batch()
    core.queue_replay(b, h, cancel_marked=False, regenerate=False)  # the manual Tracker's replay()
    (opening,) = _pushed(b)
    assert opening.tokens == (*PROMPT, *HAD) and h.regenerate == []


def test_a_second_loss_amid_them_replays_every_token_again() -> None:
    core, h = _ended_one_in(Status.STATE_LOST, Reason.ENGINE_ERROR)  # lost again (a worker crash)
    assert h.status == "state_lost" and h.generated == HAD
    (again,) = _replay(core, h)
    assert again.attempt == 2 and again.tokens == PROMPT and h.regenerate == HAD and h.generated == []


def test_a_run_that_gives_up_amid_them_leaves_the_caller_every_token() -> None:
    """A timeout, its caller's cancellation or a callback's exception abandons a driven session (ProducerCore.retire):
    amid the tokens sampled again, its handle still holds every token its caller had."""
    core, h = _lost()
    run = core.start([], resume=[h])
    (opening,) = _replay(core, h)
    core.apply(h, _answer(h, opening, HAD[0]))
    assert h.generated == HAD[:1]
    core.retire(h, abandon=True)
    assert h.generated == HAD and run.live == 0


def test_a_divergence_costs_no_attempt() -> None:
    """One loss allowed (max_attempts 1): the replay samples the tokens again, diverges, and is replayed once more
    the exact way; a loss after that ends the session."""
    core, h = _lost(max_attempts=1)
    (opening,) = _replay(core, h)
    assert core.apply(h, _answer(h, opening, 99))  # HAD[0] was sampled there
    assert h.diverged and h.status == "state_lost"
    (again,) = _replay(core, h)
    assert again.attempt == 2 and again.tokens == (*PROMPT, *HAD)
    lost = StepResult(job_id=again.job_id, session_id=h.session_id, status=Status.STATE_LOST,
                      position=again.start_position, worker_id="w1", reason=Reason.ENGINE_ERROR)
    assert core.apply(h, lost)
    assert _replay(core, h) == [] and h.finished and h.status == "state_lost"


@settings(max_examples=300, deadline=None, database=None)
@given(had=st.lists(st.integers(0, 40), min_size=1, max_size=12), more=st.integers(1, 4),
       wrong_at=st.none() | st.integers(0, 15), wrong=st.integers(41, 60))
def test_searched_the_caller_is_told_each_token_once_and_a_divergence_replays_exactly(
        had: list[int], more: int, wrong_at: int | None, wrong: int) -> None:
    """Against the oracle (the session's tokens are `had` then `new`): the worker answers the replay's steps with
    them, except one token at `wrong_at` (one the session had, or a new one) sampled otherwise. What the caller is
    told (as ProducerCore.ingest passes answers on) is each new token once; a different token among those it had
    loses the attempt with `generated` the tokens it had, and the next replay re-feeds them all as prompt; a new
    token sampled otherwise is simply the session's (nothing to check it against)."""
    new = [41 + (7 * i) % 20 for i in range(more)]
    oracle = had + new
    core, h = _lost(had=had, max_tokens=len(oracle))
    (job,) = _replay(core, h)
    told: list[int] = []
    for i, tok in enumerate(oracle):
        sampled = wrong if i == wrong_at else tok
        assert core.apply(h, _answer(h, job, sampled, finished=i == len(oracle) - 1))  # max_tokens
        if not h.echo:  # ProducerCore.ingest's rule, as it is: the status is not looked at
            told.append(sampled)
        if h.status == "state_lost":  # the divergence: never past the tokens it had
            assert wrong_at is not None and wrong_at < len(had) and i == wrong_at
            assert h.diverged and h.generated == had and told == []
            (again,) = _replay(core, h)
            assert again.tokens == (*PROMPT, *had) and again.attempt == 2 and not h.regenerate
            return
        if h.finished:
            break
        (job,) = _replay(core, h)
    assert h.status == "finished" and not h.diverged
    assert told == h.generated[len(had):] and h.generated[:len(had)] == had
    assert h.generated == [wrong if i == wrong_at else t for i, t in enumerate(oracle)]


@settings(max_examples=200, deadline=None)
@given(st.integers(-2, MAX_POSITION + 2) | st.sampled_from([0, 1, MAX_POSITION, MAX_POSITION + 1]),
       st.integers(-2, MAX_GENERATE + 2) | st.sampled_from([0, 1, MAX_GENERATE, MAX_GENERATE + 1]), st.booleans())
def test_an_attempts_spec_is_the_spec_validated_again(prompt_len: int, max_tokens: int, invariant: bool) -> None:
    """producer/steps.py `attempt_spec` (a copy with two fields changed) is what validating the whole spec again
    with them gives, and refuses what that refuses."""
    from pydantic import ValidationError

    spec = SessionSpec(session_id="s1", account_id="a", route=(RouteHop(worker_id="w1", key=_key(invariant)),),
                       max_tokens=8, stop_tokens=(3, 1))
    try:
        want: SessionSpec | None = SessionSpec.model_validate(
            {**spec.model_dump(), "prompt_len": prompt_len, "max_tokens": max_tokens})
    except ValidationError:
        want = None
    try:
        got: SessionSpec | None = attempt_spec(spec, prompt_len, max_tokens)
    except ValidationError:
        got = None
    assert (got is None) == (want is None)
    if got is not None and want is not None:
        assert got == want and got.model_dump_json() == want.model_dump_json()
