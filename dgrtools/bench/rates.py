"""Rate arithmetic of a peer run: steady-state window and wall rates, medians over runs, agreement.
"""


import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


# --------------------------------------------------------------------------------------- rates
def window_rate(stamps: Sequence[Sequence[float]]) -> float:
    """Tokens/s over the window where every session is decoding: from the last first token to the first
    last token (as bench/e2e.py), so prefill and ramp-down do not blur the steady state."""
    live = [s for s in stamps if s]
    if not live:
        return 0.0
    t_start = max(s[0] for s in live)
    t_end = min(s[-1] for s in live)
    if t_end <= t_start:
        return 0.0
    n = sum(1 for s in live for t in s if t_start < t <= t_end)
    return n / (t_end - t_start)


def wall_rate(n_tokens: int, t0: float, stamps: Sequence[Sequence[float]]) -> float:
    """Tokens/s from releasing the requests to the last token, prefill included."""
    ends = [s[-1] for s in stamps if s]
    return n_tokens / (max(ends) - t0) if ends and max(ends) > t0 else 0.0


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

@dataclass
class SideResult:
    wall_tok_s: float
    decode_tok_s: float  # window rate (all sessions decoding)
    ttft_ms: float  # median over sessions, from release to first token
    tokens: list[list[int]]
    extra: dict[str, float]

def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")

def summarize(runs: dict[str, list[SideResult]]) -> dict[str, dict[str, Any]]:
    """Median figures per side, with the individual runs."""
    out: dict[str, dict[str, Any]] = {}
    for side, rs in runs.items():
        keys = sorted({k for r in rs for k in r.extra})
        out[side] = {"wall_tok_s": _median([r.wall_tok_s for r in rs]),
                     "decode_tok_s": _median([r.decode_tok_s for r in rs]),
                     "ttft_ms": _median([r.ttft_ms for r in rs]),
                     **{k: _median([r.extra[k] for r in rs if k in r.extra]) for k in keys},
                     "wall_runs": [r.wall_tok_s for r in rs], "decode_runs": [r.decode_tok_s for r in rs],
                     "extra_runs": [r.extra for r in rs]}
    return out

def token_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, float]:
    """How far two sides' greedy outputs agree, session by session."""
    pre = [common_prefix(x, y) for x, y in zip(a, b, strict=True)]
    same = sum(1 for x, y in zip(a, b, strict=True) if list(x) == list(y))
    return {"identical_sessions": same, "sessions": len(pre),
            "mean_common_prefix": sum(pre) / len(pre) if pre else 0.0}


def peer_ratios(summary: dict[str, dict[str, Any]], runs: dict[str, list[SideResult]], *,
                no_repack: bool) -> dict[str, Any]:
    """dgr over llama-server (and over the raw engine) from the medians; and per repeat, dgr against the
    server run right after it (same noise)."""
    dgr, peer = summary["dgr"], summary["llama-server"]
    raw = summary["raw fused"]["decode_tok_s"]
    ratios: dict[str, Any] = {"wall_dgr_over_server": ratio(dgr["wall_tok_s"], peer["wall_tok_s"]),
                              "decode_dgr_over_server": ratio(dgr["decode_tok_s"], peer["decode_tok_s"]),
                              "decode_dgr_over_server_timings": ratio(dgr["decode_tok_s"],
                                                                      peer["timings_decode_tok_s"]),
                              "decode_dgr_over_raw": ratio(dgr["decode_tok_s"], raw),
                              "decode_server_over_raw": ratio(peer["decode_tok_s"], raw)}
    for side in [k for k in summary if k.startswith("llama-server")]:
        key = "server" if side == "llama-server" else "server_no_repack"
        for fig in ("wall", "decode"):
            paired = [ratio(getattr(a, f"{fig}_tok_s"), getattr(b, f"{fig}_tok_s"))
                      for a, b in zip(runs["dgr"], runs[side], strict=True)]
            ratios[f"paired_{fig}_dgr_over_{key}"] = paired
    if no_repack:
        nr = summary["llama-server --no-repack"]
        ratios["wall_dgr_over_server_no_repack"] = ratio(dgr["wall_tok_s"], nr["wall_tok_s"])
        ratios["decode_dgr_over_server_no_repack"] = ratio(dgr["decode_tok_s"], nr["decode_tok_s"])
    return ratios
