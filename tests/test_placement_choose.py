"""Placement's pure choice (producer/placement_choice.py `choose`), by property against an oracle written here from
docs/placement.md: never a worker without the key, with a stale heartbeat or draining; never a full worker while
another has room; the same inputs (in any order) give the same worker; with no summary the least loaded wins;
a worker holding the prompt's prefix wins among equally loaded ones; the imbalance guard overrides the cache."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from producer import ProducerCore, WorkerInfo
from producer.placement import Candidate, Choice, PlacementPolicy, SessionTemplate, choose, eligible
from schemas.limits import WIRE_VERSION
from schemas.prefix import PrefixSummary, block_ids, cached_blocks, prefix_root
from tests.test_transport import make_key

POLICY = PlacementPolicy()
KEYS = ("pre", "dec")
IDS = block_ids(list(range(160)), prefix_root("pre", "a:acct"), 16)  # 10 blocks
# Another prompt's chain, sharing no block with IDS: every prompt's ids start at a first block (ids chain their
# parents, so a later block's id is never another prompt's first: the pool index relies on it)
ALT = block_ids(list(range(1000, 1160)), prefix_root("pre", "a:acct"), 16)


@st.composite
def candidates(draw: st.DrawFn) -> list[Candidate]:
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        slots = draw(st.integers(0, 6))
        out.append(Candidate(
            worker_id=f"w{i}", digests=frozenset(draw(st.sampled_from([KEYS, ("pre",), ("other", "dec"), KEYS]))),
            slots=slots, load=draw(st.integers(0, 8)), queued=draw(st.integers(0, 20)),
            heartbeat_age_s=draw(st.one_of(st.none(), st.floats(0, 10))), draining=draw(st.booleans()),
            block_tokens=16, scope="account", held=frozenset(IDS[:draw(st.integers(0, len(IDS)))])))
    return out


def ok(c: Candidate) -> bool:
    """The oracle's eligibility, from the doc's words."""
    return (set(KEYS) <= c.digests and c.heartbeat_age_s is not None and c.heartbeat_age_s <= POLICY.stale_s
            and not c.draining and c.slots > 0)


@settings(max_examples=300, deadline=None)
@given(candidates(), st.randoms(use_true_random=False))
def test_never_an_ineligible_worker_never_full_while_room_and_deterministic(cs: list[Candidate], rnd: object) -> None:
    ids_for = {(16, "account"): IDS}
    got = choose(cs, KEYS, POLICY, ids_for)
    good = [c for c in cs if ok(c)]
    if not good:
        assert got is None
        return
    assert got is not None
    chosen = next(c for c in cs if c.worker_id == got.worker_id)
    assert ok(chosen)
    if any(c.room > 0 for c in good):
        assert chosen.room > 0
    shuffled = list(cs)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert choose(shuffled, KEYS, POLICY, ids_for) == got
    assert got.eligible == len(good)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=10))
def test_without_a_summary_the_least_loaded_with_room_wins(loads: list[tuple[int, int]]) -> None:
    cs = [Candidate(worker_id=f"w{i:02d}", digests=frozenset(KEYS), slots=s, load=min(b, s))
          for i, (s, b) in enumerate(loads)]
    got = choose(cs, KEYS, POLICY)
    assert got is not None
    pool = [c for c in cs if c.room > 0] or cs
    best = min(pool, key=lambda c: (c.load / c.slots, c.load, c.worker_id))
    guarded = max(c.load for c in pool) - min(c.load for c in pool) > POLICY.balance_abs
    if not guarded:
        assert got.worker_id == best.worker_id


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(IDS)), min_size=2, max_size=6), st.integers(0, 3))
def test_among_equally_loaded_the_longest_cached_prefix_wins(held: list[int], load: int) -> None:
    cs = [Candidate(worker_id=f"w{i}", digests=frozenset(KEYS), slots=8, load=load, block_tokens=16,
                    scope="account", held=frozenset(IDS[:n])) for i, n in enumerate(held)]
    got = choose(cs, KEYS, POLICY, {(16, "account"): IDS})
    assert got is not None
    assert got.cached_blocks == max(held)
    assert got.worker_id == f"w{held.index(max(held))}"  # ties: the first id


def test_a_prefix_held_out_of_order_counts_only_up_to_the_first_miss() -> None:
    gap = frozenset(IDS[:2] + IDS[3:])  # block 2 missing: only 2 leading blocks cached
    cs = [Candidate(worker_id="a", digests=frozenset(KEYS), slots=8, load=0, block_tokens=16, scope="account",
                    held=gap),
          Candidate(worker_id="b", digests=frozenset(KEYS), slots=8, load=0, block_tokens=16, scope="account",
                    held=frozenset(IDS[:3]))]
    got = choose(cs, KEYS, POLICY, {(16, "account"): IDS})
    assert got is not None and got.worker_id == "b" and got.cached_blocks == 3


def test_the_imbalance_guard_sends_to_the_least_loaded_whatever_it_holds() -> None:
    hot = Candidate(worker_id="hot", digests=frozenset(KEYS), slots=64, load=20, block_tokens=16, scope="account",
                    held=frozenset(IDS))
    cold = Candidate(worker_id="cold", digests=frozenset(KEYS), slots=64, load=2)
    got = choose([hot, cold], KEYS, POLICY, {(16, "account"): IDS})
    assert got is not None and got.worker_id == "cold" and got.guarded
    # within the guard's bounds the cache wins
    warm = Candidate(worker_id="hot", digests=frozenset(KEYS), slots=64, load=6, block_tokens=16, scope="account",
                     held=frozenset(IDS))
    got = choose([warm, cold], KEYS, POLICY, {(16, "account"): IDS})
    assert got is not None and got.worker_id == "hot" and not got.guarded and got.cached_blocks == len(IDS)


def test_stale_draining_and_keyless_workers_are_never_chosen_even_alone() -> None:
    for c in (Candidate(worker_id="s", digests=frozenset(KEYS), slots=4, load=0, heartbeat_age_s=POLICY.stale_s + 1),
              Candidate(worker_id="n", digests=frozenset(KEYS), slots=4, load=0, heartbeat_age_s=None),
              Candidate(worker_id="d", digests=frozenset(KEYS), slots=4, load=0, draining=True),
              Candidate(worker_id="k", digests=frozenset({"pre"}), slots=4, load=0)):
        assert choose([c], KEYS, POLICY) is None


# ------------------------------------------------------------------------------- the core on a fleet read


def fleet(n: int, summaries: dict[int, list[int]] | None = None, busy: int = 0) -> list[WorkerInfo]:
    """n workers advertising the test key; worker i's heartbeat holds the block ids of `summaries[i]`."""
    key = make_key("prefill")
    keys = [key.for_phase("prefill"), key.for_phase("decode")]
    out = []
    for i in range(n):
        hb: dict[str, object] = {"ts": time.time(), "slots": 8, "busy_slots": busy}
        if summaries and i in summaries:
            ids = block_ids(summaries[i], prefix_root(keys[0].digest, "a:acct"), 16)
            hb["prefix"] = PrefixSummary.of(16, "account", ids).as_json()
        out.append(WorkerInfo(worker_id=f"w{i}", keys=keys, info={"wire_version": WIRE_VERSION}, alive=True,
                              heartbeat_age_s=0.0, heartbeat=hb))
    return out


def tmpl(sid: str) -> SessionTemplate:
    return SessionTemplate(session_id=sid, account_id="acct", keys=(make_key("prefill"),))


def test_place_follows_the_advertised_prefix_and_then_what_it_sent() -> None:
    system = list(range(1000, 1064))  # 4 blocks
    core = ProducerCore()
    core.fleet.load(fleet(4, {2: system}), 0.0)
    spec = core.place_loaded(tmpl("p0"), [*system, 1, 2, 3])
    assert spec.route[0].worker_id == "w2"
    assert core.fleet.last["w2"].cached_blocks == 4
    other = list(range(5000, 5064))  # nobody holds it: the least loaded (w0), then it sticks there
    first = core.place_loaded(tmpl("p1"), other).route[0].worker_id
    assert first != "w2"
    core.fleet.started("p1")  # its first token read: its 64 rows computed, no longer a wait there
    again = core.place_loaded(tmpl("p2"), [*other, 9]).route[0].worker_id
    assert again == first and core.fleet.last[first].cached_blocks == 4


def test_a_worker_amid_a_long_prompt_is_passed_over_until_its_first_token() -> None:
    """Pending prompt rows (Candidate.pending): with equal loads and nothing cached, a worker computing the 512
    rows of a session placed there costs the next prompt that wait, so another takes it; once the first token
    is read (`started`) the rows are no longer pending."""
    core = ProducerCore()
    core.fleet.load(fleet(2), 0.0)
    a = core.place_loaded(tmpl("a"), list(range(3000, 3512))).route[0].worker_id
    b = core.place_loaded(tmpl("b"), list(range(4000, 4032))).route[0].worker_id
    assert a != b and core.fleet.candidates[a].pending == 512 and core.fleet.candidates[b].pending == 32
    core.fleet.started("a")
    core.fleet.started("b")
    assert core.fleet.candidates[a].pending == 0 and core.fleet.pending == {} and core.fleet.prefilling == {}


def test_place_by_load_alone_balances_without_any_summary() -> None:
    core = ProducerCore()
    core.fleet.load(fleet(5), 0.0)
    placed = [core.place_loaded(tmpl(f"b{i}"), [i + 1] * 20).route[0].worker_id for i in range(40)]
    counts = {w: placed.count(w) for w in set(placed)}
    assert sorted(counts.values()) == [8] * 5  # 8 slots each, 40 sessions: every worker full, none over


def choose_as_first_written(candidates: list[Candidate], digests: tuple[str, ...], policy: PlacementPolicy,
                            ids_for: dict[tuple[int, str | None], list[str]]) -> Choice | None:
    """choose() before it was made cheaper (docs/placement.md, "Cost"), kept as the reference it must equal."""
    ok = [c for c in candidates if c.heartbeat_age_s is not None and c.heartbeat_age_s <= policy.stale_s
          and not c.draining and c.slots > 0 and all(d in c.digests for d in digests)]
    if not ok:
        return None
    pool = [c for c in ok if c.room > 0] or ok
    loads = [c.load for c in pool]
    lo, hi = min(loads), max(loads)
    guarded = hi - lo > policy.balance_abs and hi > policy.balance_rel * lo
    best: tuple[tuple[float, int, str], Choice] | None = None
    for c in pool:
        ids = ids_for.get((c.block_tokens or 0, c.scope), ())
        held = frozenset(c.held) | frozenset(c.sent)  # what the worker holds: its summary and what was sent it
        hit = cached_blocks(ids, held) if ids and held else 0
        miss = (len(ids) - hit) / len(ids) if ids else 1.0
        cost = (policy.overlap_weight * (miss + c.pending / policy.pending_rows) + c.load / max(1, c.slots)
                + policy.queue_weight * c.queued / max(1, c.slots))
        rank = (float(c.load) if guarded else cost, c.load, c.worker_id)
        if best is None or rank < best[0]:
            best = rank, Choice(c.worker_id, cost, hit, len(ids), c.load, c.room, guarded, len(ok))
    return best[1] if best is not None else None


@st.composite
def mixed(draw: st.DrawFn) -> list[Candidate]:
    """Candidates of two block sizes, some without a summary, loads on both sides of the guard, many equal costs
    (4 slots at load 2 and 8 at load 4), the blocks held split between the summary and the ids sent since."""
    out = []
    for i in range(draw(st.integers(1, 12))):
        bt = draw(st.sampled_from([16, 32, None]))
        out.append(Candidate(
            worker_id=f"w{draw(st.integers(0, 99)):02d}-{i}", digests=frozenset(KEYS),
            slots=draw(st.sampled_from([0, 4, 8, 64])),
            load=draw(st.one_of(st.integers(0, 12), st.integers(0, 70))), queued=draw(st.sampled_from([0, 0, 4, 9])),
            heartbeat_age_s=draw(st.sampled_from([0.0, 1.0, None, 7.0])), draining=draw(st.booleans()),
            block_tokens=bt, scope=None if bt is None else "account",
            held=frozenset(IDS[:draw(st.integers(0, len(IDS)))]),
            # ids sent since the summary: any of them, so a prompt's leading blocks alternate between the two sets
            sent=frozenset(draw(st.lists(st.sampled_from(IDS), max_size=len(IDS)))),
            pending=draw(st.sampled_from([0, 0, 0, 64, 700, 5000]))))
    return out


@settings(max_examples=400, deadline=None)
@given(mixed(), st.sampled_from([PlacementPolicy(), PlacementPolicy(overlap_weight=3.0, queue_weight=0.1),
                                 PlacementPolicy(balance_abs=0, balance_rel=1.0)]))
def test_choose_equals_the_choice_as_first_written(cs: list[Candidate], policy: PlacementPolicy) -> None:
    ids_for = {(16, "account"): IDS, (32, "account"): IDS[:4], (0, None): IDS[:6]}
    assert choose(cs, KEYS, policy, ids_for) == choose_as_first_written(cs, KEYS, policy, ids_for)


@settings(max_examples=300, deadline=None)
@given(mixed(), st.lists(st.integers(0, 4), max_size=30),
       st.sampled_from([PlacementPolicy(), PlacementPolicy(overlap_weight=0.0), PlacementPolicy(balance_abs=2)]))
def test_the_pool_index_chooses_as_choose_placement_after_placement(cs: list[Candidate], prompts: list[int],
                                                                    policy: PlacementPolicy) -> None:
    """FleetView's index (producer/pool_index.py) against choose() on the same candidates, as each session placed
    adds to its worker's load and held blocks (note), several prompts sharing leading blocks."""
    from producer.placement import FleetView

    view = FleetView()
    view.candidates = {c.worker_id: replace(c, held=set(c.held)) for c in cs}
    view.pools = {KEYS: list(view.candidates)}  # type: ignore[dict-item]
    for k in prompts:
        # what place_hops gives it: per group, the ids of prompts that share leading blocks (a chain's prefixes),
        # of one first block or another
        ids_for = {(16, "account"): IDS[:3 + k], (32, "account"): (ALT if k % 2 else IDS)[:k + 1],
                   (0, None): IDS[:k + 1]}
        got, full = view.choose(KEYS, policy, ids_for)  # type: ignore[arg-type]
        pool = list(view.candidates.values())
        assert got == choose(pool, KEYS, policy, ids_for)
        assert sorted(full) == sorted(c.worker_id for c in pool if c.load >= c.slots and eligible(c, KEYS, policy))
        if got is None:
            return
        picked = view.candidates[got.worker_id]
        view.note(got, ids_for[(picked.block_tokens or 0, picked.scope)], [])  # its own group's ids, as place_hops


# Prompts of one first block that part at different blocks: a system prompt (blocks 0-3) and others sharing only
# its first blocks, each with suffixes of its own (tokens are what parts them; block ids chain their parents).
SYSTEM = list(range(64))
BRANCHES = [block_ids(SYSTEM[:16 * cut] + [200 + b] * (16 * (6 - cut)), prefix_root("pre", "a:acct"), 16)
            for cut in (1, 2, 4) for b in range(3)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, len(BRANCHES) - 1), st.integers(0, 6), st.integers(0, 9)),
                min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, len(BRANCHES) - 1), st.booleans()), max_size=30),
       st.sampled_from([PlacementPolicy(), PlacementPolicy(balance_abs=2), PlacementPolicy(overlap_weight=3.0)]))
def test_the_pool_index_counts_prompts_that_part_after_their_first_block_as_choose(
        workers: list[tuple[int, int, int, int]], sessions: list[tuple[int, bool]], policy: PlacementPolicy) -> None:
    """The index keeps each holder's leading run per first block (PoolIndex.runs) and counts the next prompt of that
    first block from it: against choose() when prompts part at any block after the first, each placement adding
    its prompt to its worker's sent set and its rows to the worker's pending ones, some prompts sent again, some
    sessions' rows no longer pending (their first token)."""
    from producer.placement import FleetView

    cs = {}
    for i, (load, branch, held, queued) in enumerate(workers):
        cs[f"w{i}"] = Candidate(worker_id=f"w{i}", digests=frozenset(KEYS), slots=8, load=load, queued=queued,
                                block_tokens=16, scope="account", held=frozenset(BRANCHES[branch][:held]),
                                pending=64 * (i % 3))
    view = FleetView()
    view.candidates = cs
    view.pools = {KEYS: list(cs)}  # type: ignore[dict-item]
    for j, (branch, again) in enumerate(sessions):
        ids = BRANCHES[branch]
        ids_for = {(16, "account"): ids}
        got, _ = view.choose(KEYS, policy, ids_for)  # type: ignore[arg-type]
        assert got == choose(list(view.candidates.values()), KEYS, policy, ids_for)
        if got is None:
            return
        if again:  # counted with runs kept across placements: a prompt placed just before, then another
            assert view.choose(KEYS, policy, ids_for)[0] == got  # type: ignore[arg-type]
            view.started(f"s{j - 1}")  # the one before has its first token: its rows no longer pending
        view.note(got, ids, [], f"s{j}", 700 * (branch % 4))


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 9)), max_size=40), st.integers(1, 30))
def test_sent_prompts_keep_the_last_within_the_bound(sends: list[tuple[int, int]], limit: int) -> None:
    """The ids a Tracker remembers sending one worker: the last prompt's always, at most `limit` counted per
    prompt unless one prompt alone is longer, and an older prompt's only while the later ones leave room."""
    from producer.placement import SentPrompts

    sent = SentPrompts(limit)
    prompts = [block_ids(list(range(16 * (n + 1))) + [s] * 16, prefix_root("pre", "a:acct"), 16) for s, n in sends]
    for i, ids in enumerate(prompts):
        sent.add(ids)
        assert set(ids) <= sent.ids()
        assert sent.count == sum(len(p) for p in sent.prompts.values())
        assert sent.count <= limit or len(sent.prompts) == 1
        kept, room = [], limit
        for p in reversed(prompts[:i + 1]):  # the newest first, each prompt once
            if p[-1] in {q[-1] for q in kept}:
                continue
            if kept and len(p) > room:
                break
            kept.append(p)
            room -= len(p)
        assert sent.ids() == set().union(*kept)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.integers(0, 3), st.lists(st.integers(0, 2), min_size=16, max_size=64),
                                max_size=4), min_size=1, max_size=4))
def test_summaries_parsed_once_per_change_hold_what_a_fresh_parse_holds(reads: list[dict[int, list[int]]]) -> None:
    """Fleet reads one after another, each worker's summary changed, kept, dropped or new (each read's
    heartbeats fresh objects, as decoded from Redis): the candidates hold what parsing every summary anew gives."""
    import json

    from producer.placement import FleetView, candidate

    view = FleetView()
    for summaries in reads:
        workers = fleet(4, summaries)
        for w in workers:
            w.heartbeat = json.loads(json.dumps(w.heartbeat))
        view.load(workers, 0.0)
        for w in workers:
            fresh = candidate(w, 0, view._sent_ids(w.worker_id))
            got = view.candidates[w.worker_id]
            assert (got.held, got.sent, got.block_tokens, got.scope) == (fresh.held, fresh.sent, fresh.block_tokens,
                                                                         fresh.scope)
        assert set(view.summaries.last) == {w.worker_id for w in workers}


@given(st.sets(st.sampled_from(IDS)), st.sets(st.sampled_from(IDS)), st.integers(0, len(IDS)))
def test_leading_counts_the_blocks_held_in_either_set(held: set[str], sent: set[str], n: int) -> None:
    """pool_index.leading over a summary and the ids sent since is cached_blocks over their union."""
    from producer.pool_index import leading

    assert leading(IDS[:n], frozenset(held), sent) == cached_blocks(IDS[:n], held | sent)
    assert leading(IDS[:n], held) == cached_blocks(IDS[:n], held)
