"""The Ray Serve deployment: how many replicas, with what resources, routed how.

`build_application(spec, scale)` is what `specdec serve --ray` runs; `build(args)` is the same for a
Serve config file (`serve deploy`/`serve run`), whose `args: {flags: "..."}` are `specdec serve`
flags, parsed by the same parser. The application has two deployments: the replicas (its HTTP
ingress) and the metrics hub they push to (metrics.py), bound into the replicas' arguments.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Optional

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from specdec.deploy.metrics import MetricsHub
from specdec.deploy.prefix import DEFAULT_PREFIX_CHARS, validate_prefix_chars
from specdec.deploy.replica import ReplicaSpec, SpecdecReplica
from specdec.types import SpecdecError

DEPLOYMENT_NAME = "specdec"
METRICS_HUB_NAME = "specdec-metrics"
ROUTER = "specdec.deploy.router:AffinityRouter"
# Seconds Ray Serve gives a stopping replica beyond the app's own drain grace.
SHUTDOWN_MARGIN_SECONDS = 5.0
# An API key never travels in what Ray stores: replicas and proxies read it on their nodes (replica.py).
KEY_IN_CONFIG = ("--api-key {where} would put the key in {what}: set SPECDEC_API_KEYS_FILE (a keys file on every "
                 "node), SPECDEC_API_KEYS or SPECDEC_API_KEY where each node's `ray start` runs, or pass "
                 "--api-keys-file PATH (the file at that path on every node).")


@dataclass(frozen=True)
class ScaleConfig:
    replicas: int = 1  # fixed count; with autoscaling, the count to start with
    threads_per_replica: int = 1  # the engine's CPU threads, and the CPUs Ray reserves for each replica
    min_replicas: Optional[int] = None  # both set: autoscaling on ongoing requests per replica
    max_replicas: Optional[int] = None
    # Seconds the load must stay above (below) the target before Ray adds (removes) a replica;
    # None: Ray's defaults (30 s up, 600 s down).
    upscale_delay: Optional[float] = None
    downscale_delay: Optional[float] = None
    prefix_routing_chars: int = DEFAULT_PREFIX_CHARS  # route on the prompt's first N characters; 0: off

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    def validate(self) -> None:
        if self.replicas < 1 or self.threads_per_replica < 1:
            raise SpecdecError("--replicas and --threads-per-replica must be >= 1.")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise SpecdecError("autoscaling needs both --min-replicas and --max-replicas.")
        if self.autoscaling and not (0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1):
            raise SpecdecError("autoscaling needs 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1.")
        for flag, delay in (("--upscale-delay", self.upscale_delay), ("--downscale-delay", self.downscale_delay)):
            if delay is not None and not self.autoscaling:
                raise SpecdecError(f"{flag} is an autoscaling setting: add --min-replicas and --max-replicas.")
            if delay is not None and delay < 0:
                raise SpecdecError(f"{flag} must be >= 0.")
        problem = validate_prefix_chars(self.prefix_routing_chars)
        if problem:
            raise SpecdecError(problem)


def deployment_options(spec: ReplicaSpec, scale: ScaleConfig) -> dict:
    options = dict(
        name=DEPLOYMENT_NAME,
        ray_actor_options={"num_cpus": scale.threads_per_replica},
        # A replica takes as many requests as it has slots: a request whose key's replica is full
        # goes to one with a free slot rather than wait (waiting costs more than the n-gram
        # history it loses), and Ray holds the rest, up to the server's queue size (per proxy);
        # beyond it Ray answers what `specdec serve` does, 429 with Retry-After (the proxy's
        # middleware gives it the OpenAI body, proxy.py).
        max_ongoing_requests=spec.slots,
        max_queued_requests=max(1, spec.server.max_queue),
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=spec.server.retry_after),
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER, request_router_kwargs={"prefix_chars": scale.prefix_routing_chars}),
        graceful_shutdown_timeout_s=spec.server.drain_grace + SHUTDOWN_MARGIN_SECONDS,
    )
    if scale.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": scale.min_replicas,
            "max_replicas": scale.max_replicas,
            "initial_replicas": min(max(scale.replicas, scale.min_replicas), scale.max_replicas),
            # One ongoing request per slot: more replicas once every slot is busy on average.
            "target_ongoing_requests": spec.slots,
        }
        for field, delay in (("upscale_delay_s", scale.upscale_delay), ("downscale_delay_s", scale.downscale_delay)):
            if delay is not None:
                options["autoscaling_config"][field] = delay
    else:
        options["num_replicas"] = scale.replicas
    return options


def metrics_hub_options() -> dict:
    # No CPU reserved: it only merges text, and must not take a CPU a replica was sized for.
    # Every replica pushes to it and scrapes pass through it: let them all in at once.
    return dict(name=METRICS_HUB_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)


def build_application(spec: ReplicaSpec, scale: ScaleConfig, autoscaling: Optional[dict] = None):
    """The replicas, bound last: the application's ingress, the deployment Ray's proxy sends HTTP to.

    `autoscaling`: more of Ray's autoscaling_config fields (look_back_period_s, ...), as a Serve
    config file's `deployments:` section would set them."""
    scale.validate()
    options = deployment_options(spec, scale)
    if autoscaling:
        if not scale.autoscaling:
            raise SpecdecError("autoscaling settings need --min-replicas and --max-replicas.")
        options["autoscaling_config"].update(autoscaling)
    hub = serve.deployment(MetricsHub, **metrics_hub_options()).bind()
    return serve.deployment(SpecdecReplica, **options).bind(spec, hub)


def build(args: dict):
    """Application builder for a Serve config file:

        applications:
          - name: specdec
            route_prefix: /
            import_path: specdec.deploy.app:build
            args: {flags: "--replicas 2 --threads-per-replica 1 --parallel 4"}
    """
    from specdec.deploy.cli import replica_spec, scale_config
    from specdec.server.cli import parse_serve_flags

    flags = args.get("flags", "")
    parsed = parse_serve_flags(shlex.split(flags) if isinstance(flags, str) else [str(f) for f in flags])
    if parsed.api_key:
        raise SpecdecError(KEY_IN_CONFIG.format(where="in a Serve config", what="the config, which Ray stores and "
                                                "shows (`serve config`, the dashboard)"))
    return build_application(replica_spec(parsed), scale_config(parsed))
