"""The server's settings, frozen; the CLI fills them from flags."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specdec.types import SpecConfig

MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = "specdec"
    spec: SpecConfig = field(default_factory=SpecConfig)  # what `speculative_decoding: true` / `auto` mean
    # Keys (never in a repr, so never in a log line): with any, every route but /health needs
    # `Authorization: Bearer <key>`. `api_key` is one key of the tenant "default"; `api_keys` holds
    # (key, tenant) pairs (server/tenants.py reads them from a keys file or the environment).
    api_key: Optional[str] = field(default=None, repr=False)
    api_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # Without keys every client is anonymous: False gives each request no cross-request history
    # (nobody drafts from another's text); True lets all anonymous requests share one.
    shared_history: bool = False
    public_metrics: bool = False  # /metrics without the key when keys are set
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
    body_timeout: float = 60.0  # seconds for the whole request body to arrive; then 408
    write_timeout: float = 60.0  # seconds a response's writes may stay blocked (a reader stopped reading); then cut
    sse_keepalive: float = 15.0  # seconds without an event before a stream sends `: keep-alive`
    # One token per streamed chunk: a chunk per decoding step would say how many drafted tokens each
    # step accepted (a side channel on the prompt and on shared histories, arXiv 2411.01076).
    stream_one_token_per_chunk: bool = True
    # uvicorn (`specdec serve` only; a Ray proxy has its own):
    header_timeout: float = 10.0  # seconds for a request's headers to arrive once its first byte has
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's default)
    limit_concurrency: Optional[int] = 1024  # connections (and requests) at once; beyond that uvicorn answers 503
    max_header_bytes: int = 16 * 1024  # request line and headers still arriving (h11's bound; past it: 400)
