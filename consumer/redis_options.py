"""The Redis connection options every `dgr` command shares (consumer, inspect, ops, demo, tracker-sim):
declared once here, each with its DGR_* environment variable, and turned into a `RedisTarget`
(consumer/connect.py) by `target()`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:  # imported when used: `dgr --help` loads no Redis client
    from .connect import RedisTarget

RedisUrl = Annotated[str, typer.Option(
    envvar="DGR_REDIS_URL",
    help="Redis URL (redis://user:pass@host:port/db, rediss:// for TLS). With --redis-sentinel only its "
         "user, password, db and TLS settings are used.")]
RedisSentinel = Annotated[str, typer.Option(
    envvar="DGR_REDIS_SENTINEL",
    help="Sentinels, host:port[,host:port...]: connect to the master they name (--sentinel-master) and "
         "follow its failovers.")]
SentinelMaster = Annotated[str, typer.Option(envvar="DGR_SENTINEL_MASTER",
                                             help="The master's name the sentinels monitor.")]
SentinelUsername = Annotated[str, typer.Option(envvar="DGR_SENTINEL_USERNAME",
                                               help="ACL user of the sentinels themselves (if they require one).")]
SentinelPassword = Annotated[str, typer.Option(envvar="DGR_SENTINEL_PASSWORD",
                                               help="Password of the sentinels themselves (if they require one).")]
RedisClusterFlag = Annotated[bool, typer.Option("--cluster/--no-cluster", envvar="DGR_REDIS_CLUSTER",
                                                help="The URL names a Redis Cluster node.")]


def target(url: str, sentinel: str = "", sentinel_master: str = "", sentinel_username: str = "",
           sentinel_password: str = "", cluster: bool = False) -> RedisTarget:
    """The options as a RedisTarget; a contradiction (sentinels without a master name, sentinels and
    a Cluster) is a usage error."""
    from .connect import RedisTarget

    try:
        return RedisTarget(url=url, sentinel=sentinel, sentinel_master=sentinel_master,
                           sentinel_username=sentinel_username, sentinel_password=sentinel_password, cluster=cluster)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
