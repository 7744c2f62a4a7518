"""The server's settings, frozen; the CLI fills them from flags."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specdec.types import SpecConfig


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = "specdec"
    spec: SpecConfig = field(default_factory=SpecConfig)  # what `speculative_decoding: true` / `auto` mean
    api_key: Optional[str] = None  # every route but /health then needs `Authorization: Bearer <key>`
    max_queue: int = 64  # requests waiting for a slot; beyond that, 429
    max_tokens: int = 1024  # the cap when a request gives no max_tokens
    request_timeout: float = 600.0  # seconds from arrival; then the generation is cut (finish_reason "length")
    drain_grace: float = 30.0  # seconds in-flight requests may run on once the server is asked to stop
    stall_timeout: float = 120.0  # seconds a worker iteration (backend calls) may take before the server is unhealthy
    retry_after: int = 1  # seconds, in the Retry-After header of a 429
    prefill_chunk: int = 512  # prompt tokens processed per scheduler iteration (long prompts don't stall others)
    batch_verify: bool = True  # one batched target forward for all sequences; False: one forward each
    switch_to_better_build: bool = True  # move onto specdec's ik build once its background build is done (upgrade.py)
