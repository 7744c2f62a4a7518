"""`specdec serve`: the OpenAI-compatible server on the engine.

SIGTERM (or Ctrl-C) drains (drain.py): new requests get 503 while the socket stays open, the
requests in flight finish for up to `--drain-grace` seconds, the rest end with an error, and only
then does the server stop listening.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from specdec.deploy.prefix import DEFAULT_PREFIX_CHARS  # no Ray there: plain `specdec serve` never imports it
from specdec.types import SpecConfig, SpecdecError

API_KEY_ENV = "SPECDEC_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.runtime import add_method_arguments, add_model_arguments

    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help=f"require `Authorization: Bearer KEY` on every route but /health (or set {API_KEY_ENV})")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send and /v1/models lists (default: the target file's stem)")
    add_method_arguments(parser)
    parser.add_argument("--parallel", type=int, default=4, help="slots: sequences generated concurrently (default 4)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting for a slot before new ones get 429 (default 64)")
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="tokens generated when a request sets no max_tokens (default 1024)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may take; then its generation is cut (default 600)")
    parser.add_argument("--drain-grace", type=float, default=30.0,
                        help="seconds in-flight requests may run on after SIGTERM (default 30)")
    parser.add_argument("--stall-timeout", type=float, default=120.0,
                        help="seconds a backend call may take before the server reports itself unhealthy and fails "
                             "the requests in flight (default 120)")
    parser.add_argument("--sequential-verify", action="store_true",
                        help="verify each stream in its own target forward instead of one batched forward for all "
                             "(slower with several streams; for backends whose batched logits are not exact)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_model_arguments(parser)
    add_ray_arguments(parser)


RAY_DEFAULTS = {"address": None, "replicas": 1, "threads_per_replica": 1, "min_replicas": None, "max_replicas": None,
                "upscale_delay": None, "downscale_delay": None, "engine_factory": None,
                "prefix_routing_chars": DEFAULT_PREFIX_CHARS}


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray Serve (scale-out; needs the `ray` extra, docs/scale-out.md)")
    group.add_argument("--ray", action="store_true",
                       help="serve through Ray Serve: several replicas, each with its own engine, behind --host/--port")
    group.add_argument("--address", default=None,
                       help="a running Ray cluster to join (e.g. HEAD_IP:6379); default: start a local Ray instance")
    group.add_argument("--replicas", type=int, default=RAY_DEFAULTS["replicas"],
                       help="replicas (default 1; with autoscaling, the initial count)")
    group.add_argument("--threads-per-replica", type=int, default=RAY_DEFAULTS["threads_per_replica"],
                       help="each replica's CPU threads, and the CPUs Ray reserves for it (default 1)")
    group.add_argument("--min-replicas", type=int, default=None,
                       help="with --max-replicas: autoscale on ongoing requests per replica (target: --parallel)")
    group.add_argument("--max-replicas", type=int, default=None)
    group.add_argument("--upscale-delay", type=float, default=None, metavar="SECONDS",
                       help="with autoscaling: seconds the load must stay above the target before a replica is added "
                            "(default: Ray's, 30)")
    group.add_argument("--downscale-delay", type=float, default=None, metavar="SECONDS",
                       help="with autoscaling: seconds the load must stay below the target before a replica is removed "
                            "(default: Ray's, 600)")
    group.add_argument("--prefix-routing-chars", type=int, default=RAY_DEFAULTS["prefix_routing_chars"],
                       help="a prompt starting with at least this many characters goes to the replica that holds "
                            "that start in its prefix cache (a multiple of 256; 0: route on the API key only; "
                            f"default {DEFAULT_PREFIX_CHARS})")
    # "module:function(models, n_slots) -> Engine" each replica builds its engine with (tests: a fake).
    group.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)


def parse_serve_flags(argv: list[str]) -> argparse.Namespace:
    """`specdec serve` flags parsed as the command parses them (a Serve config file's args)."""
    parser = argparse.ArgumentParser(prog="specdec serve")
    add_arguments(parser)
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace, default_name: str) -> "ServerConfig":
    from specdec.server.config import ServerConfig

    for flag, value, low in (("--parallel", args.parallel, 1), ("--max-queue", args.max_queue, 0),
                             ("--max-tokens", args.max_tokens, 1)):
        if value < low:
            raise SpecdecError(f"{flag} must be >= {low}.")
    for flag, value in (("--request-timeout", args.request_timeout), ("--stall-timeout", args.stall_timeout),
                        ("--drain-grace", args.drain_grace)):
        if value <= 0:
            raise SpecdecError(f"{flag} must be > 0.")
    spec = SpecConfig(args.method, args.num_draft_tokens)
    spec.validate()
    if spec.method == "draft" and args.no_draft:
        raise SpecdecError("--method draft needs a draft model; drop --no-draft.")
    return ServerConfig(
        served_model_name=args.served_model_name or default_name,
        spec=spec,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_queue=args.max_queue,
        max_tokens=args.max_tokens,
        request_timeout=args.request_timeout,
        stall_timeout=args.stall_timeout,
        drain_grace=args.drain_grace,
        batch_verify=not args.sequential_verify,
    )


def run(args: argparse.Namespace) -> int:
    if args.ray:
        from specdec.deploy.cli import run as run_on_ray  # the only way in which this command imports Ray

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_on_ray(args)
    given = [name for name, default in RAY_DEFAULTS.items() if getattr(args, name) != default]
    if given:
        raise SpecdecError(f"--{given[0].replace('_', '-')} is a Ray Serve setting: add --ray.")
    from specdec.models.registry import TARGET, default_path
    from specdec.runtime import load_engine, model_config
    from specdec.server.app import create_app
    from specdec.server.drain import make_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    default_name = Path(args.model).stem if args.model else default_path(TARGET).stem
    config = build_config(args, default_name)
    engine = load_engine(model_config(args), n_slots=args.parallel)
    scheduler = None
    try:
        app = create_app(engine, config)  # its start-up calibrates `auto` (about 10 s)
        scheduler = app.state.specdec.scheduler
        server = make_server(app, args.host, args.port, args.log_level)
        logging.getLogger("specdec.server").info(
            "serving %r on http://%s:%d (method %s, k=%d, %d slots)", config.served_model_name, args.host,
            args.port, config.spec.method, config.spec.num_draft_tokens, args.parallel)
        server.run()
        return 0
    finally:
        if scheduler is None or scheduler.join(0):
            engine.close()  # never under a worker still inside a backend call (a stall): the process exits anyway
