"""`specdec serve`: the OpenAI-compatible server on the engine.

SIGTERM (or Ctrl-C) drains (drain.py): new requests get 503 while the socket stays open, the
requests in flight finish for up to `--drain-grace` seconds, the rest end with an error, and only
then does the server stop listening.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specdec.deploy.prefix import DEFAULT_PREFIX_CHARS  # no Ray there: plain `specdec serve` never imports it
from specdec.server.config import ServerConfig
from specdec.server.tenants import API_KEY_ENV, API_KEYS_ENV, API_KEYS_FILE_ENV, configured_keys
from specdec.types import SpecConfig, SpecdecError

LIMITS = ServerConfig()  # the defaults of the limits' flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.runtime import add_method_arguments, add_model_arguments

    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help=f"require `Authorization: Bearer KEY` on every route but /health (tenant \"default\"); "
                             f"prefer {API_KEY_ENV} or --api-keys-file: a flag is visible in the process list")
    parser.add_argument("--api-keys-file", default=None, metavar="PATH",
                        help=f"API keys with their tenants, lines `tenant-name key` or a JSON object (or set "
                             f"{API_KEYS_FILE_ENV}, or the text itself in {API_KEYS_ENV}); a tenant's requests share a "
                             "cross-request history, other tenants' never")
    parser.add_argument("--shared-history", action="store_true",
                        help="without API keys, let every request draft from the text of earlier ones (one "
                             "anonymous history); default: anonymous requests share nothing")
    parser.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    parser.add_argument("--allowed-hosts", default="", metavar="NAMES",
                        help="Host header names answered besides the loopback ones (comma-separated, `*.example.com` "
                             "allowed); `*` answers any. Default: on a loopback --host, only loopback names (DNS "
                             "rebinding); on any other, any name")
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
    add_limit_arguments(parser)
    add_model_arguments(parser)
    add_ray_arguments(parser)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits for slow and hostile clients (docs/server.md, Reliability)")
    group.add_argument("--max-body-bytes", type=int, default=LIMITS.max_body_bytes, metavar="N",
                       help=f"a larger request body is a 413, refused before it is read (default {LIMITS.max_body_bytes})")
    group.add_argument("--max-prompt-bytes", type=int, default=None, metavar="N",
                       help="a prompt of more bytes of text is refused before it is tokenized (default: the context "
                            "x 64 bytes, more than any prompt that fits it)")
    group.add_argument("--body-timeout", type=float, default=LIMITS.body_timeout, metavar="SECONDS",
                       help=f"seconds for a request body to arrive, then 408 (default {LIMITS.body_timeout:g})")
    group.add_argument("--header-timeout", type=float, default=LIMITS.header_timeout, metavar="SECONDS",
                       help=f"seconds for a request's headers to arrive, then the connection is closed "
                            f"(default {LIMITS.header_timeout:g})")
    group.add_argument("--keep-alive-timeout", type=float, default=LIMITS.keep_alive_timeout, metavar="SECONDS",
                       help=f"seconds an idle connection stays open (default {LIMITS.keep_alive_timeout:g})")
    group.add_argument("--limit-concurrency", type=int, default=LIMITS.limit_concurrency, metavar="N",
                       help=f"connections at once; beyond that, 503 (default {LIMITS.limit_concurrency}; 0: no limit)")
    group.add_argument("--max-header-bytes", type=int, default=LIMITS.max_header_bytes, metavar="N",
                       help=f"bytes of a request line and headers still arriving; past them, 400 "
                            f"(default {LIMITS.max_header_bytes})")
    group.add_argument("--write-timeout", type=float, default=LIMITS.write_timeout, metavar="SECONDS",
                       help=f"seconds a response may wait for a client that stopped reading before its connection is cut "
                            f"(a stream's generation cancelled) (default {LIMITS.write_timeout:g})")
    group.add_argument("--sse-keepalive", type=float, default=LIMITS.sse_keepalive, metavar="SECONDS",
                       help=f"seconds a stream may go without an event (queued, say) before it sends a `: keep-alive` "
                            f"comment (default {LIMITS.sse_keepalive:g})")
    group.add_argument("--coalesce-stream-chunks", action="store_true",
                       help="stream one chunk per decoding step (several tokens when drafts are accepted) instead "
                            "of one chunk per token; fewer chunks, but their sizes reveal how many drafts each step "
                            "accepted")


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


def build_config(args: argparse.Namespace, default_name: str) -> ServerConfig:
    from specdec.server.hosts import allowed_hosts_for

    for flag, value, low in (("--parallel", args.parallel, 1), ("--max-queue", args.max_queue, 0),
                             ("--max-tokens", args.max_tokens, 1), ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--max-prompt-bytes", args.max_prompt_bytes or 1, 1),
                             ("--limit-concurrency", args.limit_concurrency or 0, 0),
                             ("--max-header-bytes", args.max_header_bytes, 1024)):
        if value < low:
            raise SpecdecError(f"{flag} must be >= {low}.")
    for flag, value in (("--request-timeout", args.request_timeout), ("--stall-timeout", args.stall_timeout),
                        ("--drain-grace", args.drain_grace), ("--body-timeout", args.body_timeout),
                        ("--header-timeout", args.header_timeout), ("--keep-alive-timeout", args.keep_alive_timeout),
                        ("--write-timeout", args.write_timeout), ("--sse-keepalive", args.sse_keepalive)):
        if value <= 0:
            raise SpecdecError(f"{flag} must be > 0.")
    if args.max_prompt_bytes is not None and args.max_prompt_bytes < 1:
        raise SpecdecError("--max-prompt-bytes must be >= 1.")
    api_key, api_keys = configured_keys(args.api_key, args.api_keys_file)
    if args.api_key:
        logging.getLogger("specdec.server").warning(
            "--api-key puts the key in the process list; prefer %s or --api-keys-file", API_KEY_ENV)
    spec = SpecConfig(args.method, args.num_draft_tokens)
    spec.validate()
    if spec.method == "draft" and args.no_draft:
        raise SpecdecError("--method draft needs a draft model; drop --no-draft.")
    return ServerConfig(
        served_model_name=args.served_model_name or default_name,
        spec=spec,
        api_key=api_key,
        api_keys=api_keys,
        shared_history=args.shared_history,
        public_metrics=args.public_metrics,
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts.split(",")),
        max_queue=args.max_queue,
        max_tokens=args.max_tokens,
        request_timeout=args.request_timeout,
        stall_timeout=args.stall_timeout,
        drain_grace=args.drain_grace,
        batch_verify=not args.sequential_verify,
        max_body_bytes=args.max_body_bytes,
        max_prompt_bytes=args.max_prompt_bytes,
        body_timeout=args.body_timeout,
        write_timeout=args.write_timeout,
        sse_keepalive=args.sse_keepalive,
        stream_one_token_per_chunk=not args.coalesce_stream_chunks,
        header_timeout=args.header_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        limit_concurrency=args.limit_concurrency or None,
        max_header_bytes=args.max_header_bytes,
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
            "serving %r on http://%s:%d (method %s, k=%d, %d slots; the playground at /)", config.served_model_name,
            args.host, args.port, config.spec.method, config.spec.num_draft_tokens, args.parallel)
        server.run()
        return 0
    finally:
        if scheduler is None or scheduler.join(0):
            engine.close()  # never under a worker still inside a backend call (a stall): the process exits anyway
