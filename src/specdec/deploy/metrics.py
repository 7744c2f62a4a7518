"""One Prometheus scrape for a whole Ray deployment: every replica's series, labelled `replica`.

Each replica's metrics live in its own process (server/metrics.py, one registry per app). Every
replica pushes its registry's samples to `MetricsHub`, a one-replica Serve deployment, every
PUSH_INTERVAL_SECONDS and when it answers `GET /metrics`; the hub answers that scrape with the
samples of every replica heard from, merged into one family per metric. A replica that stops says
so; one that was killed is forgotten after EXPIRY_INTERVALS missed pushes.

Data flows one way: replica -> hub -> the scrape's response. No Ray import here: the hub is a
plain class that app.py makes a deployment, and the replica passes its handle in.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable, Mapping, Optional

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

from specdec.server.metrics import ServerMetrics

logger = logging.getLogger("specdec.deploy")

REPLICA_LABEL = "replica"
PUSH_INTERVAL_SECONDS = 2.0
# A scrape waits this long for the hub, then answers with the asking replica's own series alone.
SCRAPE_TIMEOUT_SECONDS = 5.0
# Missed pushes after which a replica is taken for dead: a scrape shows a killed replica's series
# for at most this many intervals.
EXPIRY_INTERVALS = 3


def snapshot(metrics: ServerMetrics) -> list[Metric]:
    """The registry's families now (gauges read at this moment), as plain picklable objects."""
    return list(metrics.registry.collect())


class MergedReplicas:
    """A prometheus_client collector: each family once, with the samples of every replica under it,
    labelled with the replica's id (counters keep `_total`, histograms their buckets: the
    families are the registries' own, so generate_latest writes them as a single registry)."""

    def __init__(self, replicas: Mapping[str, Iterable[Metric]]):
        self.replicas = replicas

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for replica in sorted(self.replicas):
            for family in self.replicas[replica]:
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(sample._replace(labels={**sample.labels, REPLICA_LABEL: replica})
                                      for sample in family.samples)
        return families.values()


def merge_replicas(replicas: Mapping[str, Iterable[Metric]]) -> bytes:
    """Prometheus text format of every replica's families (replica id -> its snapshot)."""
    return generate_latest(MergedReplicas(replicas))


class MetricsHub:
    """The deployment every replica pushes to (one replica; state is rebuilt within one push
    interval if Ray restarts it). Methods are async: they run one at a time on its event loop."""

    def __init__(self, push_interval: float = PUSH_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.expiry = push_interval * EXPIRY_INTERVALS
        self.clock = clock
        self.replicas: dict[str, tuple[float, list[Metric]]] = {}  # id -> (when heard, snapshot)

    async def push(self, replica: str, families: list[Metric]) -> None:
        self.replicas[replica] = (self.clock(), families)

    async def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    async def exposition(self, replica: str, families: list[Metric]) -> bytes:
        """The asking replica's fresh snapshot, then every live replica's, merged."""
        await self.push(replica, families)
        oldest = self.clock() - self.expiry
        self.replicas = {r: heard for r, heard in self.replicas.items() if heard[0] >= oldest}
        return merge_replicas({r: families for r, (_, families) in self.replicas.items()})


class HubLink:
    """A replica's side: pushes its app's metrics to the hub in the background, and produces the
    merged text for the app's /metrics (create_app's `metrics_exposition`)."""

    def __init__(self, hub, replica: str, push_interval: float = PUSH_INTERVAL_SECONDS,
                 scrape_timeout: float = SCRAPE_TIMEOUT_SECONDS):
        self.hub = hub  # a DeploymentHandle to MetricsHub
        self.replica = replica
        self.push_interval = push_interval
        self.scrape_timeout = scrape_timeout
        self.task: Optional[asyncio.Task] = None

    async def exposition(self, metrics: ServerMetrics) -> bytes:
        families = snapshot(metrics)
        try:
            return await asyncio.wait_for(self.hub.exposition.remote(self.replica, families), self.scrape_timeout)
        except asyncio.CancelledError:
            raise
        except Exception:  # the hub down or restarting: a partial scrape beats a failed one
            logger.warning("metrics hub unavailable: /metrics shows this replica only", exc_info=True)
            return merge_replicas({self.replica: families})

    def start(self, metrics: ServerMetrics) -> None:
        self.task = asyncio.get_running_loop().create_task(self.push_forever(metrics))

    async def push_forever(self, metrics: ServerMetrics) -> None:
        while True:
            try:
                await self.hub.push.remote(self.replica, snapshot(metrics))
            except asyncio.CancelledError:
                raise
            except Exception:  # the hub restarting: the next push rebuilds its entry
                logger.warning("could not push metrics to the hub", exc_info=True)
            await asyncio.sleep(self.push_interval)

    async def stop(self) -> None:
        """Stop pushing and drop this replica's series now, not EXPIRY_INTERVALS later."""
        if self.task is not None:
            self.task.cancel()
        try:
            # Bounded: when the whole application is deleted the hub may be stopping too.
            await asyncio.wait_for(self.hub.forget.remote(self.replica), timeout=self.push_interval)
        except Exception:  # the hub forgets it anyway once its pushes stop
            logger.warning("could not remove this replica's metrics from the hub", exc_info=True)
