"""One Ray Serve replica: an engine built from the same configuration as `specdec serve`,
served by the same FastAPI app (`create_app`). The app's lifespan calibrates `auto` at start and
drains at stop, as under uvicorn; Ray Serve runs it when the replica starts and when it is
stopped (after Serve itself has stopped routing to it and waited for its requests). Its /metrics
answers with the series of every replica of the deployment, gathered by the metrics hub
(metrics.py)."""
from __future__ import annotations

import fcntl
import importlib
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Optional

import ray
from ray import serve

from specdec.backends.registry import ModelConfig
from specdec.config import SpecdecConfig
from specdec.deploy.metrics import HubLink
from specdec.engine.engine import Engine
from specdec.server.app import create_app
from specdec.server.config import ServerConfig
from specdec.server.tenants import (
    API_KEY_ENV, API_KEYS_ENV, API_KEYS_FILE_ENV, DEFAULT_TENANT, METRICS_KEY_ENV, configured_keys, configured_metrics_key,
)
from specdec.types import SpecdecError

logger = logging.getLogger("specdec.deploy")

DEFAULT_ENGINE_FACTORY = "specdec.runtime:load_engine"


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: the configuration, pickled once by Ray and sent to each. Never
    an API key: Ray keeps the spec (its controller's checkpoint) and the keys reach each replica
    through its node's environment or a keys file (`keys_on_this_node`)."""

    config: SpecdecConfig  # its server without keys, its keys file's path absolute
    # The tenants the deployment was started with keys of, sorted: a replica whose node has keys of
    # others, or none, refuses to start rather than serve under them (names only, never keys; more
    # keys of the same tenants, a rotation, are fine).
    key_tenants: tuple[str, ...] = ()
    metrics_key: bool = False  # started with a metrics key: a replica whose node has none refuses to start

    @property
    def models(self) -> ModelConfig:
        return self.config.models

    @property
    def server(self) -> ServerConfig:
        return self.config.server

    @property
    def slots(self) -> int:
        return self.config.slots  # sequences each replica generates at once

    @property
    def engine_factory(self) -> str:
        """"module:function", called as function(models, n_slots=slots, engine=engine) -> Engine."""
        return self.config.scale.engine_factory or DEFAULT_ENGINE_FACTORY

    @property
    def api_keys_file(self) -> Optional[str]:
        return self.config.server.api_keys_file  # read on each replica's node


def key_tenants(api_key: Optional[str], api_keys: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    return tuple(sorted({tenant for _, tenant in api_keys} | ({DEFAULT_TENANT} if api_key else set())))


def replica_spec(config: SpecdecConfig) -> ReplicaSpec:
    """What the replicas of `config`'s deployment build: each engine on the threads Ray reserves
    for it, the server's keys taken out (with what a replica needs to find them again)."""
    models, scale, server = config.models, config.scale, config.server
    if models.threads is not None and models.threads != scale.threads_per_replica:
        raise SpecdecError("with --ray, a replica's threads are --threads-per-replica; drop --threads.")
    api_keys_file = server.api_keys_file or os.environ.get(API_KEYS_FILE_ENV)
    stored = replace(server, api_key=None, api_keys=(), metrics_key=None,
                     api_keys_file=str(Path(api_keys_file).resolve()) if api_keys_file else None)
    return ReplicaSpec(replace(config, models=replace(models, threads=scale.threads_per_replica), server=stored),
                       key_tenants(server.api_key, server.api_keys), server.metrics_key is not None)


def keys_on_this_node(spec: ReplicaSpec, environ: Optional[Mapping[str, str]] = None) -> ServerConfig:
    """The replica's server settings with the keys of this node: those of its environment (the
    environment its `ray start` ran in: SPECDEC_API_KEY, SPECDEC_API_KEYS, SPECDEC_API_KEYS_FILE,
    SPECDEC_METRICS_KEY) and of `spec.api_keys_file`. Other tenants than the deployment was started
    with, or no metrics key where it was started with one, are an error."""
    environ = os.environ if environ is None else environ
    api_key, api_keys = configured_keys(None, spec.api_keys_file, environ)
    found = key_tenants(api_key, api_keys)
    if spec.key_tenants and found != spec.key_tenants:
        raise SpecdecError(
            f"this replica's node has API keys of the tenants {list(found)}, but the deployment was started with "
            f"keys of {list(spec.key_tenants)}: give every node the same keys, in the environment of its `ray "
            f"start` ({API_KEYS_FILE_ENV}, {API_KEYS_ENV} or {API_KEY_ENV}) or in a keys file at the same path.")
    metrics_key = configured_metrics_key(None, api_key, api_keys, environ)
    if spec.metrics_key and metrics_key is None:
        raise SpecdecError(f"the deployment was started with a metrics key, but this replica's node has none: set "
                           f"{METRICS_KEY_ENV} in the environment of its `ray start`.")
    return replace(spec.server, api_key=api_key, api_keys=api_keys, metrics_key=metrics_key)


def import_callable(path: str) -> Callable:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def pull_default_models(models: ModelConfig) -> None:
    """The default pair, fetched and verified on this node if it has not got it yet (`specdec
    models pull`'s code and cache). A lock, because the replicas of one node share that cache;
    a model already there is only checked (size, and the sha256 stamp of an earlier check)."""
    from specdec.models.pull import pull, verify_cached
    from specdec.models.registry import DRAFT, TARGET, default_path

    wanted = [spec for spec, path in ((TARGET, models.target), (DRAFT, models.draft if models.load_draft else ""))
              if path is None]
    if not wanted:
        return
    lock_path = default_path(TARGET).parent / ".pull.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for spec in wanted:
            try:
                verify_cached(default_path(spec), spec)
            except SpecdecError:
                logger.info("pulling %s onto this node", spec.name)
                pull(spec)


class ReplicaHeaders:
    """Name the replica and the Ray node that answered (`X-Specdec-Replica`, `X-Specdec-Node`):
    which replica a key lives on, which one a failed stream was on."""

    def __init__(self, app, replica: str, node: str):
        self.app = app
        self.headers = [(b"x-specdec-replica", replica.encode()), (b"x-specdec-node", node.encode())]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *self.headers]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


@serve.ingress()  # the app is built per replica, around its own engine (__serve_build_asgi_app__)
class SpecdecReplica:
    # async: Ray runs it on the replica's event loop, where the metrics pushes then run.
    async def __init__(self, spec: ReplicaSpec, metrics_hub):
        server = keys_on_this_node(spec)  # before the models load: a node without the keys fails at once
        if spec.engine_factory == DEFAULT_ENGINE_FACTORY:
            pull_default_models(spec.models)
        self.engine: Engine = import_callable(spec.engine_factory)(spec.models, n_slots=spec.slots,
                                                                  engine=spec.config.engine)
        replica = serve.get_replica_context().replica_id.unique_id
        self.hub_link = HubLink(metrics_hub, replica)
        # Not `self.app`: Ray's ASGI wrapper, which this class becomes, has a read-only `app`.
        self.specdec_app = create_app(self.engine, server, metrics_exposition=self.hub_link.exposition)
        self.specdec_app.add_middleware(ReplicaHeaders, replica=replica, node=ray.get_runtime_context().get_node_id())
        self.hub_link.start(self.specdec_app.state.specdec.metrics)

    def __serve_build_asgi_app__(self):
        return self.specdec_app

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose backend has stalled, or whose worker has
        died, is replaced (a drain is not a failure)."""
        health = self.specdec_app.state.specdec.scheduler.health()
        if health.status == "unhealthy":
            raise RuntimeError(f"specdec replica unhealthy: {health.reason}")

    async def __del__(self):
        # Ray Serve calls this after the app's lifespan has drained and stopped the scheduler.
        if getattr(self, "hub_link", None) is not None:
            await self.hub_link.stop()
        # Never close the models under a worker still inside a backend call: the process ends anyway.
        app = getattr(self, "specdec_app", None)
        if app is not None and app.state.specdec.scheduler.join(0):
            self.engine.close()
