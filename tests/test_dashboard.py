"""The Grafana dashboard reads metrics the worker really exports, and the monitoring profile is wired.

Every PromQL expression in deploy/grafana/dashboards/dgr-worker.json is parsed for the metric names it
reads; a worker runs a few sessions and its /metrics is scraped over HTTP; each name must be a sample
that scrape shows, or one that appears only after an event the run does not cause (`TO_WIRE`: a Redis
outage), which must then be declared at least. The latency helpers (TTFT, inter-token latency) and the outage
listener are tested on their own.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import yaml
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from consumer.engines.reference import NumpyReferenceEngine
from consumer.metrics import Metrics
from dgrtools.localredis import free_port
from schemas import Reason, Status, StepJob, StepResult
from schemas.retry import OutageRider, RetryPolicy

from .support import prompts
from .test_worker_inprocess import Driver, make_worker

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy/grafana/dashboards/dgr-worker.json"

# Declared in consumer/metrics.py, recorded once the rewritten worker loop (issue 21) calls them:
# where, in docs/operations.md ("Monitoring"). Until then they are in the scrape without samples.
TO_WIRE = {"dgr_redis_outages_total", "dgr_redis_outage_seconds_total"}  # only after an outage
# What issue 25 asks the dashboard to show, by the metric that shows it.
REQUIRED = {"dgr_fused_batch_sessions_sum", "dgr_fused_batch_sessions_count", "dgr_engine_seconds_total",
            "dgr_input_lag_entries", "dgr_input_pending_entries", "dgr_time_to_first_token_seconds_bucket",
            "dgr_inter_token_latency_seconds_bucket", "dgr_dead_letters_total", "dgr_redis_outages_total",
            "dgr_redis_unreachable"}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions or aggregations
    (followed by '('), keywords, label names (in {...} or by/without/on/ignoring/group_x lists),
    strings, numbers, durations or Grafana variables."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors and subqueries
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # Grafana variables
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"(?<![\w:])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?(?![\w:])", " ", s)  # numbers, durations
    names: set[str] = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    out: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            text = query["query"] if isinstance(query, dict) else query
            out.append(re.sub(r"^label_values\(([^,)]+).*$", r"\1", text))  # label_values(metric, label)
    return out


def test_the_promql_parser_finds_metrics_and_nothing_else() -> None:
    assert promql_metric_names('histogram_quantile(0.99, sum by (worker, le) (rate(a_bucket{w=~"$w"}'
                               '[$__rate_interval])))') == {"a_bucket"}
    assert promql_metric_names("sum(rate(x_total[5m])) by (phase) / on (worker) group_left max(y) * 1e3 "
                               "+ z offset 5m > bool 0.5") == {"x_total", "y", "z"}
    assert promql_metric_names('max by (worker) (dgr_slots{phase="decode",x="a{b}"})') == {"dgr_slots"}


def _scrape_after_sessions(fake_redis: redis.Redis, model: Path) -> tuple[set[str], set[str]]:
    """(names with samples, names declared) in the /metrics of a worker that served a few sessions."""
    engine = NumpyReferenceEngine(model, n_slots=4, ctx_per_session=256)
    worker = make_worker(fake_redis, engine, prefix_cache_bytes=1 << 24)  # the prefix cache's gauges too
    d = Driver(fake_redis, worker)
    for i, p in enumerate(prompts(3, 300, seed=7)):
        d.open(f"dash{i}", p, max_tokens=5)
    key = d.key.for_phase("decode")  # and an undecodable entry: a dead letter
    fake_redis.xadd(d.keys.input_stream(key.digest, "decode"), {"junk": "1"})
    for _ in range(40):
        worker.run_once()
        d.poll()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=worker.metrics.registry)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        thread.join(5)
        engine.close()
    sampled: set[str] = set()
    declared: set[str] = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                    "gauge": ("",)}.get(fam.type, ("",))
        declared |= {fam.name + s for s in suffixes}
        sampled |= {s.name for s in fam.samples}
    return sampled, declared


def test_every_dashboard_expression_reads_metrics_the_worker_exports(fake_redis: redis.Redis,
                                                                      tiny_model_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 15
    sampled, declared = _scrape_after_sessions(fake_redis, tiny_model_path)
    used: set[str] = set()
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        used |= names
        missing = {n for n in names if n not in sampled and not (n in TO_WIRE and n in declared)}
        assert not missing, f"{expr!r} reads {sorted(missing)}, which the worker does not export"
    assert used >= REQUIRED, f"the dashboard shows nothing of {sorted(REQUIRED - used)}"
    assert {"dgr_time_to_first_token_seconds_bucket", "dgr_inter_token_latency_seconds_bucket"} <= sampled
    assert declared >= TO_WIRE


def test_the_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"], p["title"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "worker"}


def test_the_monitoring_profile_scrapes_the_consumer_and_provisions_the_dashboard() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], name
        for volume in services[name]["volumes"]:
            assert (ROOT / volume.split(":")[0]).exists(), volume
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    consumer_env = services["consumer"]["environment"]
    assert targets == [f"consumer:{consumer_env['DGR_METRICS_PORT']}"]
    assert consumer_env["DGR_METRICS_ADDR"] == "0.0.0.0"  # reachable from the prometheus container
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/dgr.yml").read_text())
    mount = next(v for v in services["grafana"]["volumes"] if "dashboards:" in v and "provisioning" not in v)
    assert provider["providers"][0]["options"]["path"] == mount.split(":")[1]


# ------------------------------------------------------------------------------- the helpers


def _answer(sid: str, position: int, token: int | None, *, phase: str = "decode", created_at: float = 0.0,
            finished: bool = False, status: Status = Status.OK) -> SimpleNamespace:
    reason = None if status == Status.OK else Reason.CANCELLED
    result = StepResult(job_id=f"{sid}-{position}", session_id=sid, status=status, reason=reason,  # type: ignore[arg-type]
                        position=position, token=token, finished=finished, worker_id="w")
    job = StepJob(job_id=f"{sid}-{position}", session_id=sid, phase=phase, compat="0" * 16,  # type: ignore[arg-type]
                  start_position=max(0, position - 1), tokens=(1,), sample=True, created_at=created_at)
    return SimpleNamespace(result=result, job=job)


def _hist(m: Metrics, name: str) -> tuple[float, float]:
    reg = m.registry
    return (reg.get_sample_value(f"{name}_count", {"worker": "w"}) or 0.0,
            reg.get_sample_value(f"{name}_sum", {"worker": "w"}) or 0.0)


def test_ttft_and_inter_token_latency() -> None:
    m = Metrics("w")
    t0 = 1000.0
    m.observe_answers([_answer("a", 5, 11, phase="prefill", created_at=t0 - 0.25),
                       _answer("b", 3, None, phase="prefill", created_at=t0)], t0)  # b: a chunk, no token
    assert _hist(m, "dgr_time_to_first_token_seconds") == (1, pytest.approx(0.25))
    m.observe_answers([_answer("a", 6, 12), _answer("b", 4, 7, phase="prefill", created_at=t0)], t0 + 0.5)
    m.observe_answers([_answer("a", 6, 12)], t0 + 0.6)  # a re-sent answer: no sample
    m.observe_answers([_answer("a", 7, 13, finished=True), _answer("b", 5, 8)], t0 + 0.8)
    assert _hist(m, "dgr_time_to_first_token_seconds") == (2, pytest.approx(0.25 + 0.5))
    assert _hist(m, "dgr_inter_token_latency_seconds") == (3, pytest.approx(0.5 + 0.3 + 0.3))
    assert "a" not in m._last_token  # finished: forgotten
    m.observe_answers([_answer("b", 0, None, status=Status.CANCELLED)], t0 + 1)
    assert not m._last_token
    m.observe_answers([_answer("c", 9, 1)], t0 + 2)  # first seen mid-decode (an earlier process opened it)
    assert _hist(m, "dgr_time_to_first_token_seconds")[0] == 2 and "c" in m._last_token


def test_the_outage_listener_counts_what_the_rider_rides_through() -> None:
    import logging

    m = Metrics("w")
    rider = OutageRider(RetryPolicy(max_s=5, base_s=0.001, cap_s=0.002), logging.getLogger("t"), "t", listener=m)
    calls = iter([redis.ConnectionError("down"), redis.ConnectionError("down"), "ok"])
    seen: list[float | None] = []

    def fn() -> str:
        seen.append(m.registry.get_sample_value("dgr_redis_unreachable", {"worker": "w"}))
        x = next(calls)
        if isinstance(x, Exception):
            raise x
        return x

    assert rider.call(fn) == "ok"
    assert seen == [0, 1, 1]  # up, then unreachable from the first failure on
    reg = m.registry
    assert reg.get_sample_value("dgr_redis_unreachable", {"worker": "w"}) == 0
    assert reg.get_sample_value("dgr_redis_outages_total", {"worker": "w"}) == 1
    assert 0 < (reg.get_sample_value("dgr_redis_outage_seconds_total", {"worker": "w"}) or 0) < 1
    gave_up = OutageRider(RetryPolicy(max_s=0.0, base_s=0.001), logging.getLogger("t"), "t", listener=m)
    time_before = reg.get_sample_value("dgr_redis_outage_seconds_total", {"worker": "w"})

    def down() -> None:
        time.sleep(0.002)
        raise redis.ConnectionError("down")

    with pytest.raises(redis.ConnectionError):
        gave_up.call(down)
    assert reg.get_sample_value("dgr_redis_outages_total", {"worker": "w"}) == 1  # not ridden through
    assert reg.get_sample_value("dgr_redis_outage_seconds_total", {"worker": "w"}) > time_before  # type: ignore[operator]
