"""The Ray Serve deployment's settings (replicas, threads, autoscaling, the cluster), without Ray:
the configuration (specdec/config.py) holds them whether or not Ray is installed."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from specdec.deploy.prefix import DEFAULT_PREFIX_CHARS, validate_prefix_chars
from specdec.types import SpecdecError


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
    address: Optional[str] = None  # a running Ray cluster to join (HEAD_IP:6379); None: a local Ray instance
    # "module:function" each replica builds its engine with, called as function(models, n_slots=,
    # engine=); None: specdec.runtime:load_engine. Tests name a fake.
    engine_factory: Optional[str] = None

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

    def refuse_without_ray(self) -> None:
        """A server that runs without Ray takes none of these settings: one given is a mistake."""
        default = ScaleConfig()
        for each in fields(self):
            if getattr(self, each.name) != getattr(default, each.name):
                raise SpecdecError(f"--{each.name.replace('_', '-')} is a Ray Serve setting: add --ray.")
