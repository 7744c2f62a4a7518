"""The Ray Serve deployment: how many replicas, with what resources, routed how.

`build_application(spec, scale)` is what `specdec serve --ray` runs; `build(args)` is the same for a
Serve config file (`serve deploy`/`serve run`), whose `args` hold the configuration's sections as
a TOML file does (specdec/config.py). The replicas receive the configuration itself (ReplicaSpec).
The application has two deployments: the replicas (its HTTP ingress) and the metrics hub they push
to (metrics.py), bound into the replicas' arguments.
"""
from __future__ import annotations

from typing import Any, Optional

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from specdec.deploy.metrics import MetricsHub
from specdec.deploy.replica import ReplicaSpec, SpecdecReplica, replica_spec
from specdec.deploy.scale import ScaleConfig  # where it lived: imported from here too
from specdec.types import SpecdecError

DEPLOYMENT_NAME = "specdec"
METRICS_HUB_NAME = "specdec-metrics"
ROUTER = "specdec.deploy.router:AffinityRouter"
# Seconds Ray Serve gives a stopping replica beyond the app's own drain grace.
SHUTDOWN_MARGIN_SECONDS = 5.0
# An API key never travels in what Ray stores: replicas and proxies read it on their nodes (replica.py).
KEY_IN_CONFIG = ("{flag} {where} would put the key in {what}: set SPECDEC_API_KEYS_FILE (a keys file on every "
                 "node), SPECDEC_API_KEYS or SPECDEC_API_KEY (the metrics key: SPECDEC_METRICS_KEY) where each "
                 "node's `ray start` runs, or pass --api-keys-file PATH (the file at that path on every node).")


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


def build(args: dict[str, Any]):
    """Application builder for a Serve config file. `args` holds the configuration's sections, as
    a TOML file (`specdec serve --config`) does, and/or `config`: such a file's path on the node
    that builds the application; SPECDEC_<SECTION>_<FIELD> variables there override both:

        applications:
          - name: specdec
            route_prefix: /
            import_path: specdec.deploy.app:build
            args:
              slots: 4
              scale: {replicas: 2, threads_per_replica: 1}
    """
    from specdec.config import load_config

    if "flags" in args:
        raise SpecdecError("a Serve config's args are the configuration's sections now (slots, models, engine, "
                           "policy, server, scale; docs/scale-out.md), not `flags`.")
    keys = {"api_key", "api_keys", "metrics_key"} & set(args.get("server") or {})
    if keys:
        flag = "--metrics-key" if keys == {"metrics_key"} else "--api-key"
        raise SpecdecError(KEY_IN_CONFIG.format(flag=flag, where="in a Serve config", what="the config, which Ray stores and "
                                                "shows (`serve config`, the dashboard)"))
    sections = {name: value for name, value in args.items() if name != "config"}
    config = load_config(file=args.get("config"), mapping=sections, keys=True, ray=True)
    return build_application(replica_spec(config), config.scale)
