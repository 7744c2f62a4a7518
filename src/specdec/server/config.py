"""The server's settings, frozen; the configuration loader (specdec/config.py) fills them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specdec.types import SpecConfig, SpecdecError

MIB = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the address to listen on (a Ray deployment's HTTP proxy's)
    port: int = 8000
    log_level: str = "info"
    served_model_name: str = "specdec"
    spec: SpecConfig = field(default_factory=SpecConfig)  # what `speculative_decoding: true` / `auto` mean
    # Keys (never in a repr, so never in a log line): with any, every route but /health needs
    # `Authorization: Bearer <key>`. `api_key` is one key of the tenant "default"; `api_keys` holds
    # (key, tenant) pairs (server/tenants.py reads them from a keys file or the environment).
    api_key: Optional[str] = field(default=None, repr=False)
    api_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    api_keys_file: Optional[str] = None  # where `api_keys` were read (a path, no secret); else $SPECDEC_API_KEYS_FILE
    # Without keys every client is anonymous: False gives each request no cross-request history
    # (nobody drafts from another's text); True lets all anonymous requests share one.
    shared_history: bool = False
    public_metrics: bool = False  # /metrics without the key when keys are set
    # The one key /metrics takes when set (no tenant's key: /metrics shows every tenant's traffic);
    # unset, tenant keys read it only while they are all one tenant's (server/tenants.py).
    metrics_key: Optional[str] = field(default=None, repr=False)
    # Host header values accepted (exact names, or "*.example.com"); None accepts any. The CLI
    # sets the loopback names for a loopback bind (DNS rebinding).
    allowed_hosts: Optional[tuple[str, ...]] = None
    max_queue: int = 64  # requests waiting for a slot; beyond that, 429
    max_tokens: int = 1024  # the cap when a request gives no max_tokens
    request_timeout: float = 600.0  # seconds from arrival; then the generation is cut (finish_reason "length")
    drain_grace: float = 30.0  # seconds in-flight requests may run on once the server is asked to stop
    stall_timeout: float = 120.0  # seconds a worker iteration (backend calls) may take before the server is unhealthy
    retry_after: int = 1  # seconds, in the Retry-After header of a 429
    prefill_chunk: int = 512  # prompt tokens processed per scheduler iteration (long prompts don't stall others)
    batch_verify: bool = True  # one batched target forward for all sequences; False: one forward each
    switch_to_better_build: bool = True  # move onto specdec's ik build once its background build is done (upgrade.py)
    # -- hostile clients (server/limits.py, docs/server.md "Reliability") -----------------------------
    max_body_bytes: int = 8 * MIB  # a larger request body is a 413, refused before it is read in full
    max_prompt_bytes: Optional[int] = None  # prompt text (UTF-8) refused before tokenizing; None: context x 64
    # Log-probability entries (n x tokens x (top logprobs + 1)) an answer that is not streamed may
    # hold; a request that could need more is a 400 asking it to stream.
    max_unstreamed_logprobs: int = 1_000_000
    body_timeout: float = 60.0  # seconds for the whole request body to arrive; then 408
    write_timeout: float = 60.0  # seconds a response's writes may stay blocked (a reader stopped reading); then cut
    sse_keepalive: float = 15.0  # seconds without an event before a stream sends `: keep-alive`
    # One token per streamed chunk: a chunk per decoding step would say how many drafted tokens each
    # step accepted (a side channel on the prompt and on shared histories, arXiv 2411.01076).
    stream_one_token_per_chunk: bool = True
    # uvicorn (`specdec serve` only; a Ray proxy has its own):
    header_timeout: float = 10.0  # seconds for a request's headers to arrive once its first byte has
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's default)
    limit_concurrency: Optional[int] = 1024  # connections (and requests) at once; beyond that 503, /health excepted (connections.py)
    max_header_bytes: int = 16 * 1024  # request line and headers still arriving (h11's bound; past it: 400)

    def validate(self) -> None:
        value: float  # int settings, then float ones
        for flag, value, low in (("--max-queue", self.max_queue, 0), ("--max-tokens", self.max_tokens, 1),
                                 ("--max-body-bytes", self.max_body_bytes, 1),
                                 ("--max-prompt-bytes", 1 if self.max_prompt_bytes is None else self.max_prompt_bytes, 1),
                                 ("--max-unstreamed-logprobs", self.max_unstreamed_logprobs, 1),
                                 ("--limit-concurrency", self.limit_concurrency or 0, 0),
                                 ("--max-header-bytes", self.max_header_bytes, 1024), ("--port", self.port, 0),
                                 ("server.retry_after", self.retry_after, 0), ("server.prefill_chunk", self.prefill_chunk, 1)):
            if value < low:
                raise SpecdecError(f"{flag} must be >= {low}.")
        for flag, value in (("--request-timeout", self.request_timeout), ("--stall-timeout", self.stall_timeout),
                            ("--drain-grace", self.drain_grace), ("--body-timeout", self.body_timeout),
                            ("--header-timeout", self.header_timeout), ("--keep-alive-timeout", self.keep_alive_timeout),
                            ("--write-timeout", self.write_timeout), ("--sse-keepalive", self.sse_keepalive)):
            if value <= 0:
                raise SpecdecError(f"{flag} must be > 0.")
        if self.log_level not in LOG_LEVELS:
            raise SpecdecError(f"--log-level must be one of {', '.join(LOG_LEVELS)}.")
        self.spec.validate()
