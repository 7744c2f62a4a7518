"""`specdec serve`: the OpenAI-compatible server on the engine.

SIGTERM (or Ctrl-C) drains (drain.py): new requests get 503 while the socket stays open, the
requests in flight finish for up to `--drain-grace` seconds, the rest end with an error, and only
then does the server stop listening. Each flag sets a key of the configuration (specdec/config.py).
"""
from __future__ import annotations

import argparse
import logging

from specdec.config import SpecdecConfig
from specdec.config_flags import Setting, Switch, add_method_arguments, add_model_arguments, config_from_args
from specdec.deploy.scale import ScaleConfig  # no Ray there: plain `specdec serve` never imports it
from specdec.server.config import LOG_LEVELS, ServerConfig
from specdec.server.tenants import API_KEY_ENV, API_KEYS_ENV, API_KEYS_FILE_ENV, METRICS_KEY_ENV

SERVER = ServerConfig()  # the flags' defaults
SCALE = ScaleConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=SERVER.host, action=Setting, key="server.host",
                        help=f"address to listen on (default {SERVER.host})")
    parser.add_argument("--port", type=int, default=SERVER.port, action=Setting, key="server.port",
                        help=f"port (default {SERVER.port})")
    parser.add_argument("--api-key", default=None, action=Setting, key="server.api_key",
                        help=f"require `Authorization: Bearer KEY` on every route but /health (tenant \"default\"); "
                             f"prefer {API_KEY_ENV} or --api-keys-file: a flag is visible in the process list")
    parser.add_argument("--api-keys-file", default=None, metavar="PATH", action=Setting, key="server.api_keys_file",
                        help=f"API keys with their tenants, lines `tenant-name key` or a JSON object (or set "
                             f"{API_KEYS_FILE_ENV}, or the text itself in {API_KEYS_ENV}); a tenant's requests share a "
                             "cross-request history, other tenants' never")
    parser.add_argument("--shared-history", action=Switch, key="server.shared_history",
                        help="without API keys, let every request draft from the text of earlier ones (one "
                             "anonymous history); default: anonymous requests share nothing")
    parser.add_argument("--public-metrics", action=Switch, key="server.public_metrics",
                        help="serve /metrics without the API key")
    parser.add_argument("--metrics-key", default=None, action=Setting, key="server.metrics_key",
                        help=f"the key /metrics takes (no tenant's key reads it: it shows every tenant's traffic); "
                             f"prefer {METRICS_KEY_ENV}: a flag is visible in the process list")
    parser.add_argument("--allowed-hosts", default="", metavar="NAMES", action=Setting, key="server.allowed_hosts",
                        to_value=lambda text: tuple(name.strip() for name in text.split(",") if name.strip()),
                        help="Host header names answered besides the loopback ones (comma-separated, `*.example.com` "
                             "allowed); `*` answers any. Default: on a loopback --host, only loopback names (DNS "
                             "rebinding); on any other, any name")
    parser.add_argument("--served-model-name", default=None, action=Setting, key="server.served_model_name",
                        help="the model name clients send and /v1/models lists (default: the target file's stem)")
    add_method_arguments(parser)
    parser.add_argument("--parallel", type=int, default=SpecdecConfig.slots, action=Setting, key="slots",
                        help=f"slots: sequences generated concurrently (default {SpecdecConfig.slots})")
    parser.add_argument("--cache-ram", type=int, default=None, metavar="MIB", action=Setting, key="engine.cache_ram_mib",
                        help="MiB of host memory for conversations' prompt starts that gave way in the KV cache, "
                             "restored from there exactly (default: 1/8 of the RAM, at most 8192; 0: none)")
    parser.add_argument("--prompt-cache-dir", default=None, metavar="DIR", action=Setting, key="engine.prompt_cache_dir",
                        help="keep conversations' prompt starts across restarts: written there when the server stops, "
                             "read back when it starts on the same machine, models and build (off by default: the "
                             "files hold the conversations' tokens)")
    parser.add_argument("--max-queue", type=int, default=SERVER.max_queue, action=Setting, key="server.max_queue",
                        help=f"requests waiting for a slot before new ones get 429 (default {SERVER.max_queue})")
    parser.add_argument("--max-tokens", type=int, default=SERVER.max_tokens, action=Setting, key="server.max_tokens",
                        help=f"tokens generated when a request sets no max_tokens (default {SERVER.max_tokens})")
    parser.add_argument("--request-timeout", type=float, default=SERVER.request_timeout, action=Setting,
                        key="server.request_timeout",
                        help=f"seconds a request may take; then its generation is cut (default {SERVER.request_timeout:g})")
    parser.add_argument("--drain-grace", type=float, default=SERVER.drain_grace, action=Setting,
                        key="server.drain_grace",
                        help=f"seconds in-flight requests may run on after SIGTERM (default {SERVER.drain_grace:g})")
    parser.add_argument("--stall-timeout", type=float, default=SERVER.stall_timeout, action=Setting,
                        key="server.stall_timeout",
                        help="seconds a backend call may take before the server reports itself unhealthy and fails "
                             f"the requests in flight (default {SERVER.stall_timeout:g})")
    parser.add_argument("--sequential-verify", action=Switch, key="server.batch_verify", value=False,
                        help="verify each stream in its own target forward instead of one batched forward for all "
                             "(slower with several streams; for backends whose batched logits are not exact)")
    parser.add_argument("--log-level", default=SERVER.log_level, choices=LOG_LEVELS, action=Setting,
                        key="server.log_level")
    add_limit_arguments(parser)
    add_model_arguments(parser)
    add_ray_arguments(parser)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits for slow and hostile clients (docs/server.md, Reliability)")

    def limit(flag: str, **kwargs) -> None:
        group.add_argument(flag, action=Setting, key="server." + flag[2:].replace("-", "_"), **kwargs)

    limit("--max-body-bytes", type=int, default=SERVER.max_body_bytes, metavar="N",
          help=f"a larger request body is a 413, refused before it is read (default {SERVER.max_body_bytes})")
    limit("--max-prompt-bytes", type=int, default=None, metavar="N",
          help="a prompt of more bytes of text is refused before it is tokenized (default: the context "
               "x 64 bytes, more than any prompt that fits it)")
    limit("--max-unstreamed-logprobs", type=int, default=SERVER.max_unstreamed_logprobs, metavar="N",
          help="log-probability entries (n x tokens x (top logprobs + 1)) an answer that is not streamed may "
               "hold; a request that could need more is a 400 asking it to stream "
               f"(default {SERVER.max_unstreamed_logprobs})")
    limit("--body-timeout", type=float, default=SERVER.body_timeout, metavar="SECONDS",
          help=f"seconds for a request body to arrive, then 408 (default {SERVER.body_timeout:g})")
    limit("--header-timeout", type=float, default=SERVER.header_timeout, metavar="SECONDS",
          help=f"seconds for a request's headers to arrive, then the connection is closed "
               f"(default {SERVER.header_timeout:g})")
    limit("--keep-alive-timeout", type=float, default=SERVER.keep_alive_timeout, metavar="SECONDS",
          help=f"seconds an idle connection stays open (default {SERVER.keep_alive_timeout:g})")
    limit("--limit-concurrency", type=int, default=SERVER.limit_concurrency, metavar="N",
          to_value=lambda n: n or None,
          help=f"connections at once; beyond that, 503 (default {SERVER.limit_concurrency}; 0: no limit)")
    limit("--max-header-bytes", type=int, default=SERVER.max_header_bytes, metavar="N",
          help=f"bytes of a request line and headers still arriving; past them, 400 "
               f"(default {SERVER.max_header_bytes})")
    limit("--write-timeout", type=float, default=SERVER.write_timeout, metavar="SECONDS",
          help=f"seconds a response may wait for a client that stopped reading before its connection is cut "
               f"(a stream's generation cancelled) (default {SERVER.write_timeout:g})")
    limit("--sse-keepalive", type=float, default=SERVER.sse_keepalive, metavar="SECONDS",
          help=f"seconds a stream may go without an event (queued, say) before it sends a `: keep-alive` "
               f"comment (default {SERVER.sse_keepalive:g})")
    group.add_argument("--coalesce-stream-chunks", action=Switch, key="server.stream_one_token_per_chunk", value=False,
                       help="stream one chunk per decoding step (several tokens when drafts are accepted) instead "
                            "of one chunk per token; fewer chunks, but their sizes reveal how many drafts each step "
                            "accepted")


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray Serve (scale-out; needs the `ray` extra, docs/scale-out.md)")

    def scale(flag: str, **kwargs) -> None:
        group.add_argument(flag, action=Setting, key="scale." + flag[2:].replace("-", "_"), **kwargs)

    group.add_argument("--ray", action="store_true",
                       help="serve through Ray Serve: several replicas, each with its own engine, behind --host/--port")
    scale("--address", default=None,
          help="a running Ray cluster to join (e.g. HEAD_IP:6379); default: start a local Ray instance")
    scale("--replicas", type=int, default=SCALE.replicas,
          help=f"replicas (default {SCALE.replicas}; with autoscaling, the initial count)")
    scale("--threads-per-replica", type=int, default=SCALE.threads_per_replica,
          help=f"each replica's CPU threads, and the CPUs Ray reserves for it (default {SCALE.threads_per_replica})")
    scale("--min-replicas", type=int, default=None,
          help="with --max-replicas: autoscale on ongoing requests per replica (target: --parallel)")
    scale("--max-replicas", type=int, default=None)
    scale("--upscale-delay", type=float, default=None, metavar="SECONDS",
          help="with autoscaling: seconds the load must stay above the target before a replica is added "
               "(default: Ray's, 30)")
    scale("--downscale-delay", type=float, default=None, metavar="SECONDS",
          help="with autoscaling: seconds the load must stay below the target before a replica is removed "
               "(default: Ray's, 600)")
    scale("--prefix-routing-chars", type=int, default=SCALE.prefix_routing_chars,
          help="a prompt starting with at least this many characters goes to the replica that holds "
               "that start in its prefix cache (a multiple of 256; 0: route on the API key only; "
               f"default {SCALE.prefix_routing_chars})")
    # "module:function(models, n_slots, engine) -> Engine" each replica builds its engine with (tests: a fake).
    scale("--engine-factory", default=None, help=argparse.SUPPRESS)


def parse_serve_flags(argv: list[str]) -> argparse.Namespace:
    """`specdec serve` flags parsed as the command parses them."""
    parser = argparse.ArgumentParser(prog="specdec serve")
    add_arguments(parser)
    return parser.parse_args(argv)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args, keys=True, ray=args.ray)
    configure_logging(config.server.log_level)
    if args.ray:
        from specdec.deploy.cli import run as run_on_ray  # the only way in which this command imports Ray

        flag = "--api-key" if args.api_key is not None else "--metrics-key" if args.metrics_key is not None else None
        return run_on_ray(config, key_on_command_line=flag)
    from specdec import runtime
    from specdec.server.app import create_app
    from specdec.server.drain import make_server

    server_config = config.server
    engine = runtime.load_engine(config.models, n_slots=config.slots, engine=config.engine)
    scheduler = None
    try:
        app = create_app(engine, server_config)  # its start-up calibrates `auto` (about 10 s)
        scheduler = app.state.specdec.scheduler
        server = make_server(app, server_config.host, server_config.port, server_config.log_level)
        logging.getLogger("specdec.server").info(
            "serving %r on http://%s:%d (method %s, k=%d, %d slots of %d tokens; the playground at /)",
            server_config.served_model_name, server_config.host, server_config.port, server_config.spec.method,
            server_config.spec.num_draft_tokens, config.slots, engine.target.n_ctx)
        server.run()
        return 0
    finally:
        if scheduler is None or scheduler.join(0):
            engine.close()  # never under a worker still inside a backend call (a stall): the process exits anyway
