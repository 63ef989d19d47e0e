"""consumer.sampling.BatchSampler, the worker's sampler stage: per-session context built only from the
fused calls it sees, so a session's tokens (and log-probabilities) are the same alone, in any batch, in
any slot, and after a replay, for every control; nothing leaks from a slot's previous session; rows it
cannot serve say why.

The "model" here gives logits that depend only on the session's context (as a real model's do), so any
difference comes from the sampler stage. The calls are built by hand, as the scheduler builds them.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.batch import EngineOutput
from consumer.sampling import BatchSampler, RowStatus, SampledCall, Vocabulary, reference
from consumer.sampling.stage import first_cut
from consumer.sched.outputs import BatchItem, ScheduledBatch
from schemas import Phase, RouteHop, Sampling, SessionSpec, StepJob
from tests.sampling_support import samplings
from tests.support import compat_key

KEY = compat_key("prefill", sha="0" * 64, ctx=4096, runtime="test")
_jobs = itertools.count()


class Model:
    """Logits of a context: a pure function of its tokens."""

    def __init__(self, vocab: int, seed: int = 0, scale: float = 3.0) -> None:
        self.vocab, self.seed, self.scale = vocab, seed, scale

    def row(self, context: list[int]) -> np.ndarray:
        h = zlib.crc32(np.asarray(context, np.int64).tobytes())
        rng = np.random.default_rng([self.seed, h, len(context)])
        return (rng.gumbel(size=self.vocab) * self.scale).astype(np.float32)


@dataclass
class Session:
    sid: str
    prompt: list[int]
    sampling: Sampling
    max_tokens: int = 12
    stop: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, tuple[int, ...], tuple[float, ...]]] = field(default_factory=list)

    def spec(self, prompt_len: int | None) -> SessionSpec:
        return SessionSpec(session_id=self.sid, account_id="acct", route=(RouteHop(worker_id="w", key=KEY),),
                           sampling=self.sampling, max_tokens=self.max_tokens, stop_tokens=self.stop,
                           prompt_len=prompt_len)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_tokens or bool(self.status and self.status[-1] != RowStatus.OK) or \
            bool(self.tokens and self.tokens[-1] in self.stop)


def _item(s: Session, slot: int, phase: Phase, start: int, toks: list[int], sample: bool,
          spec: SessionSpec | None) -> BatchItem:
    job = StepJob(job_id=f"j{next(_jobs)}", session_id=s.sid, phase=phase, compat="0" * 16, start_position=start,
                  tokens=tuple(toks), sample=sample, created_at=0.0, session=spec if start == 0 else None)
    return BatchItem(ref=None, job=job, slot=slot, offset=0, n_tokens=len(toks), row_start=0, samples=sample,
                     sampling=s.sampling if sample else None)


def _call(sampler: BatchSampler, model: Model, phase: Phase, work: list[tuple[Session, BatchItem, list[int]]],
          ranked: bool = False) -> None:
    """One fused call; work: (session, item, the session's context after the item's tokens). `ranked`: the
    output carries its rows' argmax, as the worker's engine thread takes it (EngineOutput.with_top)."""
    batch = ScheduledBatch.build(phase, [it for _, it, _ in work])
    rows = [model.row(ctx) for _, it, ctx in work if it.samples]
    output = EngineOutput.logits(np.array(rows, np.float32).reshape(len(rows), model.vocab))
    out = sampler.sample(batch, output.with_top() if ranked else output)
    sampling_work = [(s, it) for s, it, _ in work if it.samples]
    for r, (s, _) in enumerate(sampling_work):
        _record(s, out, r)


def _record(s: Session, out: SampledCall, r: int) -> None:
    s.status.append(int(out.status[r]))
    if out.status[r] == RowStatus.OK:
        s.tokens.append(int(out.tokens[r]))
    if s.sampling.logprobs is not None:
        n = s.sampling.logprobs
        s.logprobs.append((float(out.logprob[r]), tuple(out.top_ids[r, :n].tolist()),
                           tuple(out.top_logprobs[r, :n].tolist())))


@dataclass
class _Run:
    """A session being served: its slot, what it has fed, its pending prefill."""

    s: Session
    slot: int
    fed: list[int]
    pending: list[int]
    prompt_len: int | None
    first: bool = True


def serve(sampler: BatchSampler, model: Model, sessions: list[Session], *, slots: list[int], chunk: int,
          starts: list[int], replay_after: dict[str, int] | None = None, replay_slot: dict[str, int] | None = None,
          release: bool = True, ranked: bool = False) -> None:
    """Alternating prefill and decode calls; session i joins at tick starts[i] in slots[i]. A session in
    replay_after loses its state after that many tokens and comes back as prefill of prompt + generated
    (prompt_len set, as the producer re-sends it) in replay_slot[sid]. release=False: the stage is never
    told a slot was freed (it must notice position 0 itself)."""
    replay_after, replay_slot = replay_after or {}, replay_slot or {}
    active: list[_Run] = []
    waiting = sorted(range(len(sessions)), key=lambda i: starts[i])
    tick = 0
    while waiting or active:
        while waiting and starts[waiting[0]] <= tick:
            i = waiting.pop(0)
            s = sessions[i]
            active.append(_Run(s, slots[i], [], list(s.prompt), prompt_len=len(s.prompt)))
        pre, dec = [], []
        for run in active:
            if run.pending:
                toks, run.pending = run.pending[:chunk], run.pending[chunk:]
                start = len(run.fed)
                run.fed += toks
                spec = run.s.spec(run.prompt_len) if start == 0 else None
                pre.append((run.s, _item(run.s, run.slot, "prefill", start, toks, not run.pending, spec),
                            list(run.fed)))
            else:
                tok = run.s.tokens[-1]
                start = len(run.fed)
                run.fed.append(tok)
                dec.append((run.s, _item(run.s, run.slot, "decode", start, [tok], True, None), list(run.fed)))
        for phase, work in (("prefill", pre), ("decode", dec)):
            if work:
                _call(sampler, model, phase, work, ranked)  # type: ignore[arg-type]
        for run in list(active):
            s = run.s
            if s.done:
                active.remove(run)
                if release:
                    sampler.release(run.slot)
            elif replay_after.get(s.sid) == len(s.tokens):
                del replay_after[s.sid]
                if release:
                    sampler.release(run.slot)  # state lost: the next attempt re-sends everything
                active.remove(run)
                active.append(_Run(s, replay_slot[s.sid], [], list(s.prompt) + s.tokens, prompt_len=len(s.prompt)))
        tick += 1


def _copy(s: Session) -> Session:
    return Session(s.sid, list(s.prompt), s.sampling, s.max_tokens, s.stop)


def _outcome(s: Session) -> tuple[object, ...]:
    return tuple(s.tokens), tuple(s.status), tuple(s.logprobs)


@st.composite
def _sessions(draw: st.DrawFn, vocab: int) -> list[Session]:
    n = draw(st.integers(1, 4))
    out = []
    for i in range(n):
        s = draw(samplings(vocab))
        if s.allowed_token_ids is not None and len(s.allowed_token_ids) < 3:
            s = s.model_copy(update={"allowed_token_ids": None})
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20))
        out.append(Session(f"s{i}", prompt, s, max_tokens=draw(st.integers(1, 10)),
                           stop=tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=2)))))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_alone_batched_and_replayed_give_the_same_tokens(data: st.DataObject) -> None:
    vocab = data.draw(st.sampled_from([64, 300]))
    model = Model(vocab, seed=data.draw(st.integers(0, 99)))
    voc = Vocabulary(n_vocab=vocab, special=np.array([1, 5], np.int32), eog=np.array([2], np.int32))
    sessions = data.draw(_sessions(vocab))
    alone = []
    for s in sessions:
        c = _copy(s)
        serve(BatchSampler(voc), model, [c], slots=[0], chunk=64, starts=[0])
        alone.append(_outcome(c))
    n = len(sessions)
    shared = BatchSampler(voc, threads=data.draw(st.sampled_from([1, 3])))
    release = data.draw(st.booleans())
    for ranked in (True, False):  # the second round reuses the first round's slots (told or not that they were
        # freed); the first takes each row's argmax from the output (the engine thread's), as the worker does
        batched = [_copy(s) for s in sessions]
        slots = data.draw(st.permutations(range(n)))
        serve(shared, model, batched, slots=list(slots), chunk=data.draw(st.integers(1, 8)),
              starts=[data.draw(st.integers(0, 3)) for _ in range(n)], release=release, ranked=ranked)
        assert [_outcome(s) for s in batched] == alone
    replayed = [_copy(s) for s in sessions]
    cut = {s.sid: data.draw(st.integers(1, 3)) for s in sessions}
    planned = dict(cut)
    moved = {s.sid: (n + i) if i % 2 else i for i, s in enumerate(sessions)}  # another slot, or its own again
    serve(shared, model, replayed, slots=list(range(n)), chunk=data.draw(st.integers(1, 8)),
          starts=[0] * n, replay_after=cut, replay_slot=moved, release=release)
    assert [_outcome(s)[0] for s in replayed] == [a[0] for a in alone]
    # every session that went past its cut was replayed there (serve() drops a replay once it happens)
    assert all(s.sid not in cut or len(s.tokens) <= planned[s.sid] for s in replayed)


def test_a_slot_forgets_its_previous_session() -> None:
    """A session in a reused slot (the stage not told it was freed) samples as in a new one: its own prompt
    end, stop tokens and tokens, nothing of the previous session's."""
    vocab = 50
    model = Model(vocab, seed=3, scale=0.5)
    pen = Sampling(temperature=0.7, repetition_penalty=5.0, presence_penalty=1.0, penalty_last_n=-1,
                   penalize_prompt=False, min_tokens=3, seed=4)
    first = Session("a", [7, 8, 9, 7, 1, 1, 3, 4], pen, stop=(11,))
    second = Session("b", [7, 7], pen, max_tokens=12, stop=(12,))
    shared = BatchSampler(Vocabulary(n_vocab=vocab, eog=np.array([2], np.int32)))
    serve(shared, model, [first], slots=[0], chunk=3, starts=[0], release=False)
    fresh = _copy(second)
    serve(shared, model, [second], slots=[0], chunk=2, starts=[0], release=False)
    serve(BatchSampler(Vocabulary(n_vocab=vocab, eog=np.array([2], np.int32))), model, [fresh], slots=[0], chunk=2,
          starts=[0])
    assert second.tokens == fresh.tokens and len(second.tokens) >= 3


def test_penalties_change_what_a_session_generates() -> None:
    """Not a test that cannot fail: with a strong repetition penalty over the whole context, a session never
    repeats a token it has seen, while the same session without it does."""
    vocab = 40
    model = Model(vocab, seed=1, scale=0.3)
    plain = Session("p", [1, 2, 3], Sampling(), max_tokens=30)
    penal = Session("q", [1, 2, 3], Sampling(repetition_penalty=10.0, presence_penalty=2.0, penalty_last_n=-1),
                    max_tokens=30)
    for s in (plain, penal):
        serve(BatchSampler(vocab), model, [s], slots=[0], chunk=8, starts=[0])
    assert len(set(penal.tokens)) == 30 and not set(penal.tokens) & {1, 2, 3}
    assert len(set(plain.tokens)) < 30


def test_min_tokens_counts_from_the_prompt_end_also_after_a_replay() -> None:
    vocab = 30
    eog = 2
    model = Model(vocab, seed=5)
    boost = Sampling(min_tokens=6, logit_bias=((eog, 50.0),))  # the model would end at once
    voc = Vocabulary(n_vocab=vocab, eog=np.array([eog], np.int32))
    s = Session("m", [4, 5, 6], boost, max_tokens=10, stop=(eog,))
    serve(BatchSampler(voc), model, [s], slots=[0], chunk=2, starts=[0])
    assert s.tokens[-1] == eog and len(s.tokens) == 7 and eog not in s.tokens[:6]
    r = _copy(s)
    serve(BatchSampler(voc), model, [r], slots=[1], chunk=2, starts=[0], replay_after={"m": 3}, replay_slot={"m": 0})
    assert r.tokens == s.tokens


def test_a_gap_in_what_the_stage_saw_is_no_context() -> None:
    vocab = 20
    sampler = BatchSampler(vocab)
    s = Session("g", [1, 2], Sampling(repetition_penalty=1.5))
    it = _item(s, 0, "decode", 5, [3], True, None)  # the stage never saw positions 0-4 of slot 0
    out = sampler.sample(ScheduledBatch.build("decode", [it]), EngineOutput.logits(np.zeros((1, vocab), np.float32)))
    assert out.status.tolist() == [RowStatus.NO_CONTEXT] and out.tokens.tolist() == [-1]
    plain = Session("h", [1, 2], Sampling())  # a row that needs no context is served all the same
    it = _item(plain, 1, "decode", 5, [3], True, None)
    row = np.eye(vocab, dtype=np.float32)[4:5]
    out = sampler.sample(ScheduledBatch.build("decode", [it]), EngineOutput.logits(row))
    assert out.tokens.tolist() == [4] and out.status.tolist() == [RowStatus.OK]


def test_logprob_columns_and_the_worker_seam() -> None:
    vocab = 16
    sampler = BatchSampler(vocab)
    a = Session("a", [1, 2, 3], Sampling(logprobs=3))
    b = Session("b", [4], Sampling())
    items = [_item(a, 0, "prefill", 0, a.prompt, True, a.spec(3)), _item(b, 1, "prefill", 0, b.prompt, True, b.spec(1))]
    logits = np.log(np.array([[0.5, 0.25, 0.125] + [0.125 / 13] * 13, [0.1] * 10 + [0.4] + [0.0] * 5]) + 1e-30)
    out = sampler.sample(ScheduledBatch.build("prefill", items), EngineOutput.logits(logits.astype(np.float32)))
    assert out.tokens.tolist() == [0, 10] and out.top_ids.shape == (2, 3)
    assert out.top_ids[0].tolist() == [0, 1, 2] and np.allclose(np.exp(out.top_logprobs[0]), [0.5, 0.25, 0.125])
    assert np.isclose(out.logprob[0], np.log(0.5)) and np.isnan(out.logprob[1]) and (out.top_ids[1] == -1).all()
    assert out.token_list() == [0, 10]
    seam = BatchSampler(vocab)  # today's worker calls the stage and takes a list of ints
    assert seam(ScheduledBatch.build("prefill", items), EngineOutput.logits(logits.astype(np.float32))) == [0, 10]


def test_the_worker_seam_stands_in_the_raw_argmax_for_a_row_without_token() -> None:
    vocab = 8
    s = Session("x", [1], Sampling(allowed_token_ids=(7,), banned_token_ids=(6,)))
    logits = np.arange(vocab, dtype=np.float32)[None, :]
    logits[0, 7] = -np.inf
    items = [_item(s, 0, "prefill", 0, [1], True, s.spec(1))]
    out = BatchSampler(vocab).sample(ScheduledBatch.build("prefill", items), EngineOutput.logits(logits))
    assert out.status.tolist() == [RowStatus.NO_TOKEN]
    assert BatchSampler(vocab)(ScheduledBatch.build("prefill", items), EngineOutput.logits(logits)) == [6]


def test_rejects_rows_that_do_not_fit_the_call() -> None:
    vocab = 8
    s = Session("x", [1, 2], Sampling())
    batch = ScheduledBatch.build("prefill", [_item(s, 0, "prefill", 0, [1, 2], True, s.spec(2))])
    with pytest.raises(ValueError):
        BatchSampler(vocab).sample(batch, EngineOutput.logits(np.zeros((2, vocab), np.float32)))
    with pytest.raises(ValueError):
        BatchSampler(vocab).sample(batch, EngineOutput.logits(np.zeros((1, vocab + 1), np.float32)))
    with pytest.raises(ValueError):
        BatchSampler(vocab).sample(batch, EngineOutput.hidden(np.zeros((2, 4), np.float32)))
    quiet = ScheduledBatch.build("prefill", [_item(s, 0, "prefill", 0, [1, 2], False, s.spec(None))])
    assert len(BatchSampler(vocab).sample(quiet, EngineOutput.logits(np.zeros((0, vocab), np.float32)))) == 0


def _special_rows(data: st.DataObject) -> tuple[Vocabulary, np.ndarray, np.ndarray]:
    """A vocabulary with special tokens drawn, and 1-6 logits rows whose maxima are drawn onto them often."""
    vocab = data.draw(st.sampled_from([8, 300]))
    special = np.array(sorted(data.draw(st.sets(st.integers(3, vocab - 1), max_size=vocab // 2))), np.int32)
    n = data.draw(st.integers(1, 6))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = rng.normal(size=(n, vocab)).astype(np.float32)
    for r in range(n):
        if special.size and data.draw(st.booleans()):
            logits[r, special[data.draw(st.integers(0, special.size - 1))]] = 50.0  # its argmax is special
    return Vocabulary(n_vocab=vocab, special=special, eog=np.array([2], np.int32)), special, logits


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_plain_greedy_rows_are_the_oracles_tokens_on_special_argmaxes(data: st.DataObject) -> None:
    """The stage's shortcut for plain greedy rows (the argmax, looked up in the special mask) against the
    oracle, row for row, with the rows' maxima drawn onto special tokens often: a special argmax goes to the
    full path unless the session allows special tokens."""
    voc, _, logits = _special_rows(data)
    sessions = [Session(f"g{r}", [1], Sampling(allow_special=data.draw(st.booleans())))
                for r in range(logits.shape[0])]
    for r in data.draw(st.sets(st.integers(0, logits.shape[0] - 1))):
        logits[r, data.draw(st.integers(0, logits.shape[1] - 1))] = np.nan  # a broken row: the full path's
    sampler = BatchSampler(voc)
    items = [_item(s, r, "prefill", 0, [1], True, s.spec(1)) for r, s in enumerate(sessions)]
    if data.draw(st.booleans()):  # a later decode call of sessions seen before: observe() records nothing
        sampler.sample(ScheduledBatch.build("prefill", items), EngineOutput.logits(np.zeros_like(logits)))
        items = [_item(s, r, "decode", 1, [3], True, None) for r, s in enumerate(sessions)]
    out = sampler.sample(ScheduledBatch.build(items[0].job.phase, items), EngineOutput.logits(logits))
    assert out.tokens.tolist() == [reference.sample(logits[r], s.sampling, 2 if items[0].job.phase == "decode"
                                                    else 1, vocab=voc) for r, s in enumerate(sessions)]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_greedy_tokens_are_the_oracles_or_none(data: st.DataObject) -> None:
    """BatchSampler.greedy_tokens (a chained call's inputs, on the engine thread) against the oracle on plain
    greedy rows whose maxima are drawn onto special tokens and NaN often: the oracle's tokens when every row's
    argmax is one its session may sample, else None (the loop's full path then samples the call)."""
    voc, special, logits = _special_rows(data)
    vocab, n = voc.n_vocab, logits.shape[0]
    samplings = [Sampling(allow_special=data.draw(st.booleans())) for _ in range(n)]
    for r in range(n):
        if data.draw(st.integers(0, 9)) == 0:
            logits[r, data.draw(st.integers(0, vocab - 1))] = np.nan
    got = BatchSampler(voc).greedy_tokens(logits, lambda: samplings)
    # the definition, row by row: no NaN in the row, its maximum not a special token its session may not sample
    plain_rows = all(not np.isnan(logits[r]).any()
                     and (int(np.argmax(logits[r])) not in special.tolist() or samplings[r].allow_special)
                     for r in range(n))
    if plain_rows:
        assert got is not None and got.tolist() == [reference.sample(logits[r], samplings[r], 1, vocab=voc)
                                                    for r in range(n)]
    else:
        assert got is None


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_argmax_taken_after_the_forward_pass_is_the_one_sampled_from(data: st.DataObject) -> None:
    """The sampler takes each row's argmax from the output when the engine's thread took it (EngineOutput.top,
    issue 32 item 3) and does not take it again: a plain greedy row's token is the given index, whatever the
    rows say; every other row starts its cut from it. With the true argmax every row is the oracle's."""
    voc, _, logits = _special_rows(data)
    n, vocab = logits.shape[0], voc.n_vocab
    sessions = [Session(f"t{r}", [1], Sampling() if data.draw(st.booleans()) else Sampling(temperature=0.7, top_k=5,
                                                                                           seed=r))
                for r in range(n)]
    items = [_item(s, r, "prefill", 0, [1], True, s.spec(1)) for r, s in enumerate(sessions)]
    batch = ScheduledBatch.build("prefill", items)
    ranked = EngineOutput.logits(logits).with_top()
    assert ranked.top is not None and ranked.top.tolist() == np.argmax(logits, axis=1).tolist()
    out = BatchSampler(voc).sample(batch, ranked)
    assert out.tokens.tolist() == [reference.sample(logits[r], s.sampling, 1, vocab=voc) if out.status[r] == 0
                                   else -1 for r, s in enumerate(sessions)]
    assert out.tokens.tolist() == BatchSampler(voc).sample(batch, EngineOutput.logits(logits)).tokens.tolist()
    # a given argmax that is not the rows' own: the plain greedy rows whose given index is a token they may
    # sample take it as it is (so the sampler read it rather than taking the argmax again)
    other = (np.argmax(logits, axis=1) + 1) % vocab
    told = BatchSampler(voc).sample(batch, EngineOutput("logits", logits, other.astype(np.intp)))
    for r, s in enumerate(sessions):
        if s.sampling.greedy and not voc.special_mask[other[r]]:
            assert told.tokens[r] == other[r]


def test_an_outputs_rows_taken_keep_their_argmax() -> None:
    """EngineOutput.take (a chained call adopted without some of its rows) keeps each kept row's argmax."""
    rows = np.random.default_rng(3).normal(size=(5, 16)).astype(np.float32)
    got = EngineOutput.logits(rows).with_top().take([4, 1, 2])
    assert np.array_equal(got.rows, rows[[4, 1, 2]])
    assert got.top is not None and got.top.tolist() == np.argmax(rows[[4, 1, 2]], axis=1).tolist()
    assert EngineOutput.logits(rows).take([0]).top is None
    assert EngineOutput.hidden(rows).with_top().top is None


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_first_cut_taken_after_the_forward_pass_changes_nothing_sampled(data: st.DataObject) -> None:
    """first_cut (the engine thread's: the argmax, and the lane maxima of top-k and log-probability rows) on rows
    long enough for lane maxima (a vocabulary of 4,096 or more, not a multiple of 1,024), some with NaNs, mixed with
    rows that need none: every row's token, status and log-probabilities are those sampled without it."""
    vocab = data.draw(st.sampled_from([4096, 5000]))
    voc = Vocabulary(n_vocab=vocab, special=np.array([1, 7, 4095], np.int32), eog=np.array([2], np.int32))
    n = data.draw(st.integers(1, 5))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = (rng.gumbel(size=(n, vocab)) * data.draw(st.sampled_from([0.5, 3.0]))).astype(np.float32)
    # each row 40 above the next: another row's lane maxima (a mix-up of rows) cut a later row above its own values
    logits += np.float32(40.0) * np.arange(n - 1, -1, -1, dtype=np.float32)[:, None]
    kinds = [data.draw(st.sampled_from(["top-k", "top-k-logprobs", "greedy-logprobs", "greedy", "top-p"]))
             for _ in range(n)]
    for r in range(n):
        if data.draw(st.integers(0, 5)) == 0:
            logits[r, data.draw(st.integers(0, vocab - 1))] = np.nan
    made = {"top-k": Sampling(temperature=0.8, top_k=data.draw(st.integers(2, 40)), seed=3),  # top_k 1: greedy
            "top-k-logprobs": Sampling(temperature=0.8, top_k=5, logprobs=3, seed=4),
            "greedy-logprobs": Sampling(logprobs=data.draw(st.integers(1, 20))), "greedy": Sampling(),
            "top-p": Sampling(temperature=0.9, top_p=0.5, seed=5)}
    sessions = [Session(f"c{r}", [1], made[k]) for r, k in enumerate(kinds)]
    items = [_item(s, r, "prefill", 0, [1], True, s.spec(1)) for r, s in enumerate(sessions)]
    batch = ScheduledBatch.build("prefill", items)
    cut = first_cut(EngineOutput.logits(logits), batch)
    wanted = {r for r, k in enumerate(kinds) if k in ("top-k", "top-k-logprobs", "greedy-logprobs")}
    assert cut.cuts is not None if wanted else not cut.cuts
    assert set(cut.cuts or {}) == wanted
    for r in wanted:
        assert np.array_equal(cut.cuts[r], logits[r, :vocab - vocab % 1024].reshape(-1, 1024).max(axis=0),  # type: ignore[index]
                              equal_nan=True)
    got, alone = (BatchSampler(voc).sample(batch, out) for out in (cut, EngineOutput.logits(logits)))
    assert got.tokens.tolist() == alone.tokens.tolist() and got.status.tolist() == alone.status.tolist()
    assert np.array_equal(got.logprob, alone.logprob, equal_nan=True)
    assert got.top_ids.tolist() == alone.top_ids.tolist()
    assert np.array_equal(got.top_logprobs, alone.top_logprobs, equal_nan=True)


def test_the_lane_maxima_taken_are_the_ones_cut_by() -> None:
    """A row's log-probabilities start from the lane maxima the output carries (so the sampler did not take them
    again): maxima that say every value is above +inf leave the prefix empty, and the top ids are then the
    rest of the order by id, not the row's most likely."""
    vocab = 4096
    rows = np.random.default_rng(5).normal(size=(1, vocab)).astype(np.float32)
    s = Session("l0", [1], Sampling(logprobs=3))
    batch = ScheduledBatch.build("prefill", [_item(s, 0, "prefill", 0, [1], True, s.spec(1))])
    voc = Vocabulary.plain(vocab)
    true = BatchSampler(voc).sample(batch, first_cut(EngineOutput.logits(rows), batch))
    assert true.top_ids[0].tolist() == np.argsort(-rows[0], kind="stable")[:3].tolist()
    bogus = EngineOutput("logits", rows, np.argmax(rows, axis=1), {0: np.full(1024, np.inf, np.float32)})
    assert BatchSampler(voc).sample(batch, bogus).top_ids[0].tolist() == [0, 1, 2]


def test_the_lane_maxima_follow_their_rows_into_the_full_path() -> None:
    """With a plain greedy row first, the others take the full path as a subset of the call's rows: each keeps its
    own lane maxima there (a row given another's, 40 above its own values, would find no candidate and answer the
    wrong top ids)."""
    vocab = 4096
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(3, vocab)).astype(np.float32) + np.array([[80.0], [40.0], [0.0]], np.float32)
    sessions = [Session("g", [1], Sampling()), Session("a", [1], Sampling(logprobs=4)),
                Session("b", [1], Sampling(logprobs=4))]
    batch = ScheduledBatch.build("prefill", [_item(s, r, "prefill", 0, [1], True, s.spec(1))
                                             for r, s in enumerate(sessions)])
    got = BatchSampler(Vocabulary.plain(vocab)).sample(batch, first_cut(EngineOutput.logits(logits), batch))
    for r in (1, 2):
        assert got.top_ids[r, :4].tolist() == np.argsort(-logits[r], kind="stable")[:4].tolist()


class _LoopOnly(BatchSampler):
    def _keeps_nothing(self, batch: ScheduledBatch) -> bool:
        return False


def _kept(sampler: BatchSampler) -> dict[int, tuple[object, ...]]:
    return {slot: (st_.plain, st_.broken, st_.prompt_len, st_.stop_tokens, st_.tokens[:st_.length].tolist())
            for slot, st_ in sampler._slots.items()}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_decode_call_that_keeps_nothing_is_passed_over_as_the_loop_would(data: st.DataObject) -> None:
    """BatchSampler.observe's shortcut (`_keeps_nothing`: a decode call of plain greedy sessions seen before) against
    its loop, on decode calls of slots drawn known or not, plain or not, at position 0 or past it, restored or
    not: what each keeps of every slot stays equal."""
    plain_s, ctx_s = Sampling(), Sampling(temperature=0.8, repetition_penalty=1.3, seed=3)
    pair = (_LoopOnly(64), BatchSampler(64))
    for slot in range(6):  # each slot's session, fed its prompt (or not: a slot the stage never saw)
        if data.draw(st.booleans(), label=f"seen {slot}"):
            s = Session(f"s{slot}", [1, 2, 3], plain_s if data.draw(st.booleans(), label="plain") else ctx_s)
            it = _item(s, slot, "prefill", 0, [1, 2, 3], True, s.spec(3))
            for sampler in pair:
                sampler.observe(ScheduledBatch.build("prefill", [it]))
    for _ in range(data.draw(st.integers(1, 4), label="calls")):
        slots = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True), label="slots")
        items = []
        for slot in slots:
            s = Session(f"s{slot}", [1, 2, 3], plain_s if data.draw(st.booleans(), label="plain") else ctx_s)
            start = data.draw(st.sampled_from([0, 3, 3, 7]), label="position")
            items.append(_item(s, slot, "decode", start, [5], True, None))
        batch = ScheduledBatch.build("decode", items)
        if data.draw(st.booleans(), label="restored"):
            batch = replace(batch, restores=(SimpleNamespace(slot=slots[0], tokens=[1, 2, 3]),))
        for sampler in pair:
            sampler.observe(batch)
        assert _kept(pair[1]) == _kept(pair[0])
