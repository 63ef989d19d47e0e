"""`dgr bench fleet`: placement (docs/placement.md) against round-robin and random on one fleet, in one run;
the time from a worker's death (kill -9) to its sessions decoding again; and (`--cost`) what placing a session
costs the Tracker (`python -m dgrtools.bench.fleet --cost`).

The fleet: N consumer processes (dgrtools/bench/fleet_worker.py: the real Worker over a sleep engine costing a
fixed time per fused call plus a time per row, with the prefix cache on) on one real redis-server. The workload:
S sessions arriving over `span_s` (exponential gaps), each a random one of K system prompts plus its own suffix,
T greedy tokens each; the same prompts and arrival times for each side, each side under its own account (the
prefix cache's scope `account`: no side hits the blocks another side cached). Per side:
- hit rate: prompt tokens restored from the cache (the workers' `prefix_cache.hit_tokens`) / prompt tokens, and
  its ratio to the best placement's (each system prompt computed once, every later session hitting it);
- time to first token (arrival to first token): median and p90;
- load balance: max / mean sessions per worker over the side.
Sides: `placement` (docs/placement.md), `load-only` (the same with overlap_weight 0: by load alone, as without
any prefix summary), `round-robin` and `random` (SessionSpecs naming the worker).
Worker loss: L sessions placed, then the worker holding most of them is killed -9 once every one has a token;
for its sessions, the time from the kill to their next token (on another worker), against the Tracker's bound
`lost_s`; every session must end with its solo tokens (the sleep engine's are a hash of position and token).
`--quick`: a small fleet and workload (a smoke test). The machine is shared: read the ratios of one run.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from .common import console, save, table
from .rates import common_prefix

SIDES = ("placement", "load-only", "round-robin", "random")
VOCAB = 256  # the sleep engine's default vocabulary: prompts use ids 3..255


@dataclass(frozen=True, kw_only=True)
class Load:
    """The workload's shape (docs in the module)."""

    workers: int = 4
    slots: int = 16
    systems: int = 8
    sessions: int = 96
    system_len: int = 448
    suffix: int = 64
    tokens: int = 32
    span_s: float = 6.0
    loss_sessions: int = 16
    loss_tokens: int = 400
    step_ms: float = 2.0
    row_us: float = 50.0
    lost_s: float = 2.0
    # A worker's prefix cache: its budget, and what one saved prefix takes of it (the sleep engine keeps no
    # state: this models one, so that a worker holds only so many prompts; 0: 5 bytes, i.e. no limit).
    cache_bytes: int = 1 << 20
    state_bytes: int = 0
    # The workers' engine says it is batch-invariant (replays exact: a replay's generated tokens sampled again in
    # decode calls, producer/steps.py `regenerates`), or not, as a `fast` llama.cpp engine (replays computed as one
    # prompt); its tokens are exact either way.
    invariant: bool = True


QUICK = Load(workers=3, slots=8, systems=3, sessions=18, system_len=192, suffix=32, tokens=8, span_s=1.5,
             loss_sessions=6, loss_tokens=200, lost_s=1.0)


class FleetWorker:
    """One fleet_worker process; `kill()` is kill -9."""

    def __init__(self, url: str, worker_id: str, load: Load, log_dir: Path) -> None:
        self.worker_id, self.client = worker_id, redis.Redis.from_url(url)
        self.log_path = log_dir / f"{worker_id}.log"
        args = [sys.executable, "-m", "dgrtools.bench.fleet_worker", "--redis-url", url, "--worker-id", worker_id,
                "--slots", str(load.slots), "--step-ms", str(load.step_ms), "--row-us", str(load.row_us),
                "--cache-bytes", str(load.cache_bytes), "--state-bytes", str(load.state_bytes),
                "--ctx", str(max(1024, load.system_len + load.suffix + load.loss_tokens + 64)),
                *([] if load.invariant else ["--not-invariant"])]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def beat(self) -> dict[str, Any] | None:
        from schemas import WorkerKeys

        raw = self.client.get(WorkerKeys(self.worker_id).heartbeat)
        return json.loads(raw) if raw else None

    def beat_after(self, since: float, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            hb = self.beat()
            if hb is not None and float(hb.get("ts", 0)) >= since:
                return hb
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no heartbeat from {self.worker_id}:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.02)

    def hit_tokens(self, since: float) -> int:
        hb = self.beat_after(since)
        return int(hb["engines"][0].get("prefix_cache", {}).get("hit_tokens", 0))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


def workload(load: Load, seed: int = 7) -> tuple[list[list[int]], list[int], list[float]]:
    """The prompts, the system prompt each uses, and arrival times (seconds from the side's start)."""
    rng = np.random.default_rng(seed)
    systems = [[int(t) for t in rng.integers(3, VOCAB, load.system_len)] for _ in range(load.systems)]
    which = [int(x) for x in rng.integers(0, load.systems, load.sessions)]
    prompts = [systems[k] + [int(t) for t in rng.integers(3, VOCAB, load.suffix)] for k in which]
    gaps = rng.exponential(load.span_s / load.sessions, load.sessions)
    return prompts, which, [float(x) for x in np.cumsum(gaps) - gaps[0]]


def solo_tokens(prompt: Sequence[int], n: int) -> list[int]:
    """The session's tokens run alone (greedy on the sleep engine)."""
    from consumer.batch import FusedBatch
    from consumer.engines.sleep import SleepEngine

    eng, out, tok = SleepEngine(0.0, vocab_size=VOCAB), [], prompt[-1]
    for j in range(n):
        b = FusedBatch(phase="decode", slots=np.zeros(1, np.int32), positions=np.array([len(prompt) - 1 + j], np.int32),
                       tokens=np.array([tok], np.int32), wants_logits=np.ones(1, np.bool_))
        tok = int(eng.next_tokens(b)[0])
        out.append(tok)
    return out


def best_hit_rate(prompts: Sequence[Sequence[int]], which: Sequence[int], block: int = 16) -> float:
    """The best placement's: each session restores the full blocks it shares with an earlier session of its system
    prompt (every system prompt computed once)."""
    hit = 0
    for i, (p, k) in enumerate(zip(prompts, which, strict=True)):
        common = max((common_prefix(p, prompts[j]) for j in range(i) if which[j] == k), default=0)
        hit += common - common % block
    return hit / sum(len(p) for p in prompts)




def pct(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0..1), linear between ranks."""
    return float(np.quantile(np.asarray(xs, np.float64), q)) if xs else float("nan")


def balance(per_worker: dict[str, int], workers: Sequence[str]) -> float:
    """max / mean sessions per worker (every worker counted, those given none too)."""
    counts = [per_worker.get(w, 0) for w in workers]
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else float("nan")


def _sessions(side: str, key: Any, prompts: Sequence[Sequence[int]], workers: Sequence[str], tokens: int,
              seed: int) -> list[tuple[Any, Sequence[int]]]:
    """The side's sessions: templates (the Tracker places them) or SessionSpecs naming round-robin or random
    workers, under the side's own account."""
    from producer import SessionTemplate
    from schemas import RouteHop, Sampling, SessionSpec

    account, rnd = f"bench-{side}", random.Random(seed)
    out: list[tuple[Any, Sequence[int]]] = []
    for i, p in enumerate(prompts):
        sid = f"{side}-{i}"
        if side in ("placement", "load-only"):
            s: Any = SessionTemplate(session_id=sid, account_id=account, keys=(key,),
                                     options={"sampling": Sampling(), "max_tokens": tokens})
        else:
            w = workers[i % len(workers)] if side == "round-robin" else rnd.choice(list(workers))
            s = SessionSpec(session_id=sid, account_id=account, route=(RouteHop(worker_id=w, key=key),),
                            sampling=Sampling(), max_tokens=tokens)
        out.append((s, p))
    return out


def run_side(producer: Any, fleet: Sequence[FleetWorker], key: Any, side: str, prompts: Sequence[Sequence[int]],
             which: Sequence[int], starts: Sequence[float], tokens: int) -> dict[str, Any]:
    """One side of the workload: its hit rate, time to first token, balance, and whether its tokens are solo."""
    ids = [w.worker_id for w in fleet]
    before = {w.worker_id: w.hit_tokens(0.0) for w in fleet}
    first: dict[str, float] = {}
    where: dict[str, str] = {}

    def on_result(h: Any, r: Any) -> None:
        if r.token is not None and r.session_id not in first:
            first[r.session_id] = time.perf_counter()
            where[r.session_id] = h.worker_id

    t0 = time.perf_counter()
    done = producer.run_many(_sessions(side, key, prompts, ids, tokens, seed=11), on_result=on_result,
                             start_times=starts)
    end = time.time()
    hits = sum(w.hit_tokens(end) - before[w.worker_id] for w in fleet)
    ttft = [first[f"{side}-{i}"] - (t0 + s) for i, s in enumerate(starts) if f"{side}-{i}" in first]
    per: dict[str, int] = {}
    for w in where.values():
        per[w] = per.get(w, 0) + 1
    solo = all(list(done[f"{side}-{i}"].generated) == solo_tokens(p, tokens) for i, p in enumerate(prompts))
    return {"side": side, "hit_rate": hits / sum(len(p) for p in prompts),
            "best_hit_rate": best_hit_rate(prompts, which), "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
            "balance_max_over_mean": balance(per, ids), "per_worker": per, "sessions": len(prompts),
            "answered": len(first), "tokens_solo": solo,
            # a session that named a full worker (round-robin, random) may be refused: not solo then
            "statuses": dict(Counter(f"{h.status}:{h.reason}" if h.reason else h.status for h in done.values())),
            # per session (arrival order): what its time to first token is made of, to read a percentile by
            "per_session": [{"system": which[i], "worker": where.get(f"{side}-{i}"),
                             "cached": done[f"{side}-{i}"].cached_tokens,
                             "ttft_s": first[f"{side}-{i}"] - (t0 + s) if f"{side}-{i}" in first else None}
                            for i, s in enumerate(starts)]}


def run_loss(producer: Any, fleet: Sequence[FleetWorker], key: Any, load: Load, seed: int = 13) -> dict[str, Any]:
    """L placed sessions; once each has a token the worker holding most is killed -9: the time from the kill to
    each of its sessions' next token, and whether every session ends with its solo tokens."""
    from producer import SessionTemplate
    from schemas import Sampling

    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, load.system_len + load.suffix)]
               for _ in range(load.loss_sessions)]
    sessions = [(SessionTemplate(session_id=f"loss-{i}", account_id="bench-loss", keys=(key,),
                                 options={"sampling": Sampling(), "max_tokens": load.loss_tokens}), p)
                for i, p in enumerate(prompts)]
    started: dict[str, str] = {}
    state: dict[str, Any] = {"killed": None, "at": 0.0, "victims": set()}
    back: dict[str, float] = {}  # the kill to a moved session's first new token (its caller's)
    # the kill to its first token of the new attempt: a new one, or one it had sampled again (an exact replay's,
    # not passed to callbacks: seen on its handle at any callback)
    again: dict[str, float] = {}

    def on_result(h: Any, r: Any) -> None:
        if state["killed"] is not None:
            for sid in state["victims"] - again.keys():
                h2 = producer.core.driven.get(sid)
                if h2 is not None and h2.attempt > 0 and h2.regenerate and h2.generated:
                    again[sid] = time.perf_counter() - state["at"]
        if r.token is None:
            return
        started.setdefault(r.session_id, h.worker_id)
        if state["killed"] is None and len(started) == len(sessions):
            on = [h2.worker_id for h2 in producer.core.driven.values() if not h2.finished]
            victim = max(sorted(set(on)), key=on.count)
            state.update(killed=victim, at=time.perf_counter(),
                         victims={h2.session_id for h2 in producer.core.driven.values()
                                  if h2.worker_id == victim and not h2.finished})
            next(w for w in fleet if w.worker_id == victim).kill()
        elif state["killed"] is not None and r.session_id in state["victims"] and h.worker_id != state["killed"]:
            back.setdefault(r.session_id, time.perf_counter() - state["at"])
            again.setdefault(r.session_id, back[r.session_id])

    done = producer.run_many(sessions, on_result=on_result)
    solo = all(list(done[f"loss-{i}"].generated) == solo_tokens(p, load.loss_tokens) for i, p in enumerate(prompts))
    victims = sorted(state["victims"])
    times = [back[s] for s in victims if s in back]
    return {"killed": state["killed"], "sessions": len(sessions), "moved": len(victims), "lost_s": load.lost_s,
            "back_s_median": pct(times, 0.5), "back_s_max": max(times, default=float("nan")),
            "after_bound_s_max": max(times, default=float("nan")) - load.lost_s,
            "decoding_again_s_max": max((again[s] for s in victims if s in again), default=float("nan")),
            "not_back": len(victims) - len(times),
            "lost": sum(1 for h in done.values() if h.status != "finished" or len(h.generated) != load.loss_tokens),
            "tokens_solo": solo}


def run(out: Path, load: Load = Load(), *, echo: Callable[[str], object] = print) -> dict[str, Any]:
    """Every side on one fleet, then the loss; JSON in out/fleet.json, tables on the console."""
    from dgrtools.localredis import LocalRedis
    from producer import PlacementPolicy, Producer

    prompts, which, starts = workload(load)
    report: dict[str, Any] = {"load": asdict(load), "sides": [], "loss": None}
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(appendonly=False) as rs:
        fleet = [FleetWorker(rs.url, f"fleet-{i}", load, Path(tmp)) for i in range(load.workers)]
        try:
            for w in fleet:
                w.beat_after(0.0)
            policy = PlacementPolicy(lost_s=load.lost_s)
            producer = Producer(redis.Redis.from_url(rs.url), placement=policy)
            # load-only: the same score without the prefix term (what placement does with no summary)
            by_load = Producer(redis.Redis.from_url(rs.url),
                               placement=PlacementPolicy(overlap_weight=0.0, lost_s=load.lost_s))
            key = producer.discover(fleet[0].worker_id).keys[0]
            for side in SIDES:
                r = run_side(by_load if side == "load-only" else producer, fleet, key, side, prompts, which, starts,
                             load.tokens)
                report["sides"].append(r)
                echo(f"{side}: {json.dumps({k: v for k, v in r.items() if k not in ('per_worker', 'per_session')})}")
            report["loss"] = run_loss(producer, fleet, key, load)
            echo(f"loss: {json.dumps(report['loss'])}")
        finally:
            for w in fleet:
                w.stop()
    base = {r["side"]: r for r in report["sides"]}
    if base["placement"]["ttft_p90_s"] > 0:
        report["ttft_p90_rr_over_placement"] = base["round-robin"]["ttft_p90_s"] / base["placement"]["ttft_p90_s"]
    for t in tables(report):
        console.print(t)
    save(out, "fleet", report)
    return report


def tables(report: dict[str, Any]) -> list[Any]:
    """The sides' table and the loss's (80 columns: common.table turns them on their side when too wide)."""
    rows = [[r["side"], r["hit_rate"], r["hit_rate"] / r["best_hit_rate"] if r["best_hit_rate"] else float("nan"),
             1e3 * r["ttft_p50_s"], 1e3 * r["ttft_p90_s"], r["balance_max_over_mean"], r["tokens_solo"]]
            for r in report["sides"]]
    sides = table("dgr bench fleet: one workload, four placements", ["side", "hit rate", "of best", "ttft p50 ms",
                                                                      "ttft p90 ms", "max/mean", "solo"], rows)
    lo = report["loss"]
    loss = table("a worker killed -9", ["moved", "bound s", "decoding again max s", "back p50 s", "back max s", "lost",
                                        "solo"],
                 [[lo["moved"], lo["lost_s"], lo.get("decoding_again_s_max", float("nan")), lo["back_s_median"],
                   lo["back_s_max"], lo["lost"], lo["tokens_solo"]]])
    return [sides, loss]


def cost_fleet(workers: int, slots: int, systems: Sequence[Sequence[int]], seed: int = 3) -> list[Any]:
    """`workers` WorkerInfo of the sleep engine's key, fresh heartbeats, each busy 0..slots/2 and holding the
    blocks of two of the system prompts (its summary)."""
    from consumer.engines.base import engine_key
    from consumer.engines.sleep import SleepEngine
    from producer import WorkerInfo
    from schemas.limits import WIRE_VERSION
    from schemas.prefix import PrefixSummary, block_ids, prefix_root

    key = engine_key(SleepEngine(0.0), "prefill")
    keys = [key.for_phase("prefill"), key.for_phase("decode")]
    root = prefix_root(keys[0].digest, "a:bench")
    held = [block_ids(s, root) for s in systems]
    rng = random.Random(seed)
    out = []
    for i in range(workers):
        ids = held[i % len(held)] + held[(7 * i + 1) % len(held)]
        hb = {"ts": time.time(), "slots": slots, "busy_slots": rng.randint(0, slots // 2), "queued": rng.randint(0, 4),
              "prefix": PrefixSummary.of(16, "account", ids).as_json()}
        out.append(WorkerInfo(worker_id=f"w{i:03d}", keys=keys, info={"wire_version": WIRE_VERSION}, alive=True,
                              heartbeat_age_s=0.0, heartbeat=hb))
    return out


def _no_io(plan: Any) -> Any:
    """A plan's value, where it asks for no I/O (a fleet just read: nothing to discover)."""
    try:
        req = next(plan)
    except StopIteration as done:
        return done.value
    raise AssertionError(f"the plan asked for {req!r}")


def cost(workers: int = 100, slots: int = 64, prompt_len: int = 512, sessions: int = 1000,
         repeats: int = 5) -> dict[str, Any]:
    """µs per session of `place_loaded` (the whole choice on a fleet already read: no I/O; again with prompts as a
    tokenizer gives them, `place_loaded_fresh_us`), of the Tracker's whole `opening` of a template (placed, its
    workers noted as discovered, checked, its handle made: `opening_us`), of the SessionSpec a named worker gets
    (what opening costs without placement), of the choice alone (block ids given) through the fleet's index
    (`FleetView.choose`, what place_loaded runs) and as `choose()` defines it (one pass over the candidates), and
    of the prompt's block ids hashed whole and through the Tracker's memo (`BlockIdMemo`, what place_loaded runs,
    cold at each repeat); medians over `repeats` fresh fleets."""
    from producer import ProducerCore, SessionTemplate
    from producer.placement import choose
    from schemas.prefix import BlockIdMemo, block_ids, prefix_root

    rng = np.random.default_rng(5)
    systems = [[int(t) for t in rng.integers(3, VOCAB, prompt_len - 64)] for _ in range(64)]
    prompts = [systems[i % 64] + [int(t) for t in rng.integers(3, VOCAB, 64)] for i in range(sessions)]
    # As a tokenizer gives them: ids of a 32k vocabulary, each prompt its own int objects (CPython keeps one
    # object per id below 257 only, so the prompts above compare their shared part by identity)
    wide = [[int(t) for t in rng.integers(300, 32_000, prompt_len - 64)] for _ in range(64)]
    fresh = [[int(str(t)) for t in wide[i % 64]] + [int(t) for t in rng.integers(300, 32_000, 64)]
             for i in range(sessions)]
    fleet = cost_fleet(workers, slots, systems)
    key = fleet[0].keys[0]
    digests = (key.digest, fleet[0].keys[1].digest)
    place, named, pick, index, ids, memo, place_fresh, opening = [], [], [], [], [], [], [], []
    for r in range(repeats):
        core = ProducerCore()
        core.fleet.load(fleet, time.monotonic())
        tmpls = [SessionTemplate(session_id=f"c{r}-{i}", account_id="bench", keys=(key,)) for i in range(sessions)]
        t = time.perf_counter()
        for tm, p in zip(tmpls, prompts, strict=True):
            core.place_loaded(tm, p)
        place.append((time.perf_counter() - t) / sessions)
        opener = ProducerCore()
        opener.fleet.load(fleet, time.monotonic())
        tmpls = [SessionTemplate(session_id=f"o{r}-{i}", account_id="bench", keys=(key,)) for i in range(sessions)]
        t = time.perf_counter()
        for tm, p in zip(tmpls, prompts, strict=True):
            _no_io(opener.opening(tm, p))
        opening.append((time.perf_counter() - t) / sessions)
        real = ProducerCore()  # the same fleet, holding the wide system prompts
        real.fleet.load(cost_fleet(workers, slots, wide), time.monotonic())
        fresh_tmpls = [SessionTemplate(session_id=f"f{r}-{i}", account_id="bench", keys=(key,))
                       for i in range(sessions)]
        t = time.perf_counter()
        for tm, p in zip(fresh_tmpls, fresh, strict=True):
            real.place_loaded(tm, p)
        place_fresh.append((time.perf_counter() - t) / sessions)
        t = time.perf_counter()
        for tm in tmpls:
            tm.spec([fleet[0].worker_id])
        named.append((time.perf_counter() - t) / sessions)
        cands = core.fleet.pool(digests)
        root = prefix_root(digests[0], "a:bench")
        t = time.perf_counter()
        for p in prompts:
            block_ids(p, root)
        ids.append((time.perf_counter() - t) / sessions)
        ids_memo = BlockIdMemo()
        t = time.perf_counter()
        for p in prompts:
            ids_memo(p, root)
        memo.append((time.perf_counter() - t) / sessions)
        ids_for: dict[tuple[int, str | None], list[str]] = {(16, "account"): block_ids(prompts[0], root)}
        t = time.perf_counter()
        for _ in range(sessions):
            choose(cands, digests, core.policy, ids_for)
        pick.append((time.perf_counter() - t) / sessions)
        t = time.perf_counter()
        for _ in range(sessions):
            core.fleet.choose(digests, core.policy, ids_for)
        index.append((time.perf_counter() - t) / sessions)
    return {"workers": workers, "slots": slots, "prompt_len": prompt_len, "sessions": sessions, "repeats": repeats,
            "place_loaded_us": 1e6 * statistics.median(place), "named_spec_us": 1e6 * statistics.median(named),
            "opening_us": 1e6 * statistics.median(opening),
            "place_loaded_fresh_us": 1e6 * statistics.median(place_fresh),
            "choice_us": 1e6 * statistics.median(index),
            "choose_us": 1e6 * statistics.median(pick),
            "block_ids_us": 1e6 * statistics.median(ids), "block_ids_memo_us": 1e6 * statistics.median(memo)}


def run_cost(out: Path, **kw: Any) -> dict[str, Any]:
    r = cost(**kw)
    console.print(table(f"placement cost per session: {r['workers']} workers x {r['slots']} slots, "
                        f"{r['prompt_len']}-token prompt", ["place_loaded µs", "opening µs", "tokenizer ids µs",
                                                              "named worker µs", "choice µs", "choose() µs",
                                                              "block ids µs", "memo µs"],
                        [[r["place_loaded_us"], r["opening_us"], r["place_loaded_fresh_us"], r["named_spec_us"],
                          r["choice_us"], r["choose_us"], r["block_ids_us"], r["block_ids_memo_us"]]]))
    save(out, "fleet-cost", r)
    return r


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="dgr bench fleet (see the module's doc)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/fleet"))
    ap.add_argument("--cost", action="store_true", help="Only the placement cost (no processes).")
    ap.add_argument("--quick", action="store_true", help="A small fleet and workload (a smoke test).")
    ap.add_argument("--workers", type=int, default=100, help="--cost: workers.")
    ap.add_argument("--sessions", type=int, default=1000, help="--cost: sessions placed per repeat.")
    a = ap.parse_args(argv)
    if a.cost:
        run_cost(a.out, workers=a.workers, sessions=a.sessions, repeats=2 if a.quick else 5)
    else:
        run(a.out, QUICK if a.quick else Load())


if __name__ == "__main__":
    main()
