"""`specdec serve --ray`: the server on a Ray Serve cluster, started by one command.

Without --address it starts a local Ray instance (and stops it at the end); with one it joins a
running cluster, whose nodes each pull and verify the models their replicas load. The process
stays in the foreground; SIGTERM or Ctrl-C stops the deployment (each replica drains first).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Optional

from specdec.config import SpecdecConfig
from specdec.deploy.app import KEY_IN_CONFIG, build_application
from specdec.deploy.proxy import CALLBACK, CALLBACK_ENV, proxy_environment
from specdec.deploy.replica import ReplicaSpec, replica_spec
from specdec.deploy.scale import ScaleConfig
from specdec.server.tenants import API_KEY_ENV, API_KEYS_FILE_ENV, METRICS_KEY_ENV
from specdec.types import SpecdecError

logger = logging.getLogger("specdec.deploy")
APP_NAME = "specdec"


def local_ray_environment(config: SpecdecConfig, spec: ReplicaSpec) -> dict[str, str]:
    """What the Ray processes started here must find in their environment: the proxy's middleware
    and body limits, and the keys the proxies and replicas check (never in the deployment's
    arguments, which Ray stores)."""
    environment = {CALLBACK_ENV: os.environ.get(CALLBACK_ENV, CALLBACK), **proxy_environment(spec.server)}
    if config.server.api_key:
        environment[API_KEY_ENV] = config.server.api_key
    if spec.api_keys_file:
        environment[API_KEYS_FILE_ENV] = spec.api_keys_file
    if config.server.metrics_key:
        environment[METRICS_KEY_ENV] = config.server.metrics_key
    return environment


def connect(config: SpecdecConfig, spec: ReplicaSpec) -> None:
    """Ray: a local instance started here, or the cluster at --address."""
    import ray

    if config.scale.address is None:
        os.environ.update(local_ray_environment(config, spec))  # inherited by the Ray processes started here
        # "local": never the cluster that RAY_ADDRESS or this machine's last `ray start` names, which
        # ray.init() would otherwise join (and whose Serve this command would shut down at the end).
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=config.scale.address, log_to_driver=False)


def deploy(host: str, port: int, spec: ReplicaSpec, scale: ScaleConfig) -> None:
    """The HTTP proxy on host:port and the deployment, running."""
    from ray import serve
    from ray.serve.context import _get_global_client

    serve.start(http_options={"host": host, "port": port})
    # On a cluster whose Serve is already running, Ray keeps that proxy's address and ignores ours.
    proxy = _get_global_client().http_config
    if (proxy.host, proxy.port) != (host, port):
        raise SpecdecError(f"Ray Serve already runs on this cluster with its HTTP proxy on {proxy.host}:{proxy.port}: "
                           f"pass --host {proxy.host} --port {proxy.port}, or stop it first (`serve shutdown`).")
    serve.run(build_application(spec, scale), name=APP_NAME, route_prefix="/")
    logger.info("serving %r on http://%s:%d through Ray Serve (%s)", spec.server.served_model_name, host, port,
                f"{scale.min_replicas}..{scale.max_replicas} replicas" if scale.autoscaling
                else f"{scale.replicas} replicas")


def run(config: SpecdecConfig, key_on_command_line: Optional[str] = None) -> int:
    """`key_on_command_line`: the flag that gave a key (--api-key or --metrics-key), if one did."""
    import ray
    from ray import serve

    scale = config.scale
    if scale.address is not None and key_on_command_line:
        raise SpecdecError(KEY_IN_CONFIG.format(flag=key_on_command_line, where="with --address", what="the deployment's arguments, which "
                                                "Ray stores on the cluster"))
    spec = replica_spec(config)  # bad settings fail before Ray starts
    stop = threading.Event()
    try:
        connect(config, spec)
        # After ray.init, which installs its own SIGTERM handler (it aborts the process, exit
        # -6); before the deployment, so that a signal during its start-up still stops cleanly.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        deploy(config.server.host, config.server.port, spec, scale)
        stop.wait()
        logger.info("stopping: each replica drains for up to %gs", config.server.drain_grace)
        serve.delete(APP_NAME)  # replicas drain (the app's lifespan) before they stop
    finally:
        if scale.address is None:
            serve.shutdown()
        ray.shutdown()
    return 0
