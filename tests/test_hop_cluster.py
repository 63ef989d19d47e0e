"""Route hops on Redis Cluster: two hop workers whose hash tags live on different nodes; the completion
script that writes an output blob and deletes an input blob, and the one-MGET fetch of input blobs, each
stay in one slot (no CROSSSLOT), and the route equals the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.cluster import RedisCluster
from redis.crc import key_slot

from consumer.engines.reference import NumpyReferenceEngine
from dgrtools.tiny_model import write_tiny_model
from schemas import WorkerKeys
from tests.fixtures.cluster import LocalCluster, cluster_client, redis_cluster  # noqa: F401 (fixtures)
from tests.test_cluster import two_workers_on_different_nodes

from .hop_driver import RouteDriver, make_hop_worker
from .support import prompts, solo_generate


def test_activation_keys_share_the_workers_slot() -> None:
    for w in ("w1", "worker-7", "gpu.3_a"):
        k = WorkerKeys(w)
        slots = {key_slot(x.encode()) for x in (k.activations_in("j-1"), k.activations_out("j-2"), k.worker_account,
                                                k.result_record("j-2"), k.input_stream("0123456789abcdef", "decode"))}
        assert len(slots) == 1


def test_a_two_hop_route_through_the_cluster(cluster_client: RedisCluster, tmp_path: Path) -> None:  # noqa: F811
    c = cluster_client
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, seed=0, quant="q8_0")
    w0, w1 = two_workers_on_different_nodes(c)
    assert c.get_node_from_key(WorkerKeys(w0).base).name != c.get_node_from_key(WorkerKeys(w1).base).name
    engines = [NumpyReferenceEngine(model, n_slots=4, ctx_per_session=256, layers=r) for r in ((0, 1), (1, 2))]
    d = RouteDriver(c, [make_hop_worker(c, e, w) for e, w in zip(engines, (w0, w1), strict=True)])  # type: ignore[arg-type]
    ps = prompts(3, 500, seed=12, lo=40, hi=90)
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=4, chunk=40)
    d.run([f"s{i}" for i in range(3)])
    assert not d.failures()
    assert d.blob_bytes > 0
    whole = NumpyReferenceEngine(model, n_slots=1, ctx_per_session=256)
    for i, p in enumerate(ps):
        assert d.tokens[f"s{i}"] == solo_generate(whole, p, 4)
    with pytest.raises(Exception, match=r"CROSSSLOT|slot"):  # the check is a real one
        c.mget([WorkerKeys(w0).activations_in("x"), WorkerKeys(w1).activations_in("x")])
