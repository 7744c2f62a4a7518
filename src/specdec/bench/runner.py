"""Measuring: every configuration on every prompt, interleaved per prompt, the order alternating.

Order: warm-up, then for each prompt, for each repeat, every configuration in turn, so slow
drifts of the machine (heat, other load) hit all configurations alike. Even repeats run the
configurations in the given order (`off` first), odd repeats in reverse (`off` last), so a
systematic effect of going first or last cancels out over pairs of repeats; each record keeps its
position (`order`). Before every measured
generation the engine forgets all cross-request state (`reset_between_generations`), so no
configuration reuses the cache or the text of another. A generation that fails becomes a record
with success = false; the benchmark itself never raises on one.

Other backends can be measured in the same run (`--compare-backend`): each gets an engine of its
own, loaded beside the first, and its configurations (labelled `specdec@BACKEND:method`, with
their own `off`) are interleaved with the first engine's per prompt, so backends are compared
under the same drifts of the machine, not minutes apart.

A greedy configuration measured before its `off` waits in memory until that `off` of its prompt
and repeat is recorded, then is compared and written (a run killed in between measures it again
on resume).
After a greedy configuration's output differs from `off`'s for the same prompt and repeat, the
runner re-evaluates the target at the first differing position, outside the timed region, and
stores the target's logit margin there (top-1 minus top-2): a margin near zero means the two
runs stood on a numerical tie, a large one means a real bug.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from specdec.backends.sequence import CachedSequence
from specdec.bench.datasets import BenchPrompt
from specdec.bench.records import RecordFile, bench_record
from specdec.client.records import RequestRecord
from specdec.drafters.registry import calibrated, method_names
from specdec.types import (DEFAULT_NUM_DRAFT_TOKENS, GenerationRequest, SamplingParams,
                           SpecConfig, SpecdecError)

log = logging.getLogger(__name__)

BASELINE = "off"
WARMUP_MAX_TOKENS = 32
SOURCE = "specdec"


@dataclass(frozen=True)
class BenchConfig:
    """One measured configuration: a method and its draft length, labelled `method` or `method:kK`
    (`specdec@BACKEND:method` on a compared backend's engine)."""

    label: str
    method: str
    num_draft_tokens: int
    source: str = SOURCE  # whose engine runs it: "specdec", or "specdec@BACKEND"

    @property
    def baseline(self) -> str:
        """The label of the `off` this configuration is compared with."""
        return BASELINE if self.source == SOURCE else f"{self.source}:{BASELINE}"


def compared_source(backend: str) -> str:
    return f"{SOURCE}@{backend}"


def on_backend(configs: Sequence[BenchConfig], backend: str) -> list[BenchConfig]:
    """The same configurations on another backend's engine. Example: auto -> specdec@llama.cpp:auto."""
    source = compared_source(backend)
    return [BenchConfig(f"{source}:{c.label}", c.method, c.num_draft_tokens, source) for c in configs]


@dataclass(frozen=True)
class BenchSettings:
    """What every measured generation of a `specdec bench` run shares, and how often it runs."""

    max_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 1
    warmup: int = 1
    seed: int = 0
    tenant_history: bool = False  # each generation's tenant history: the run's earlier prompts

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def parse_bench_configs(
    methods: Sequence[str],
    num_draft_tokens: Optional[Sequence[int]] = None,
    default_k: int = DEFAULT_NUM_DRAFT_TOKENS,
) -> list[BenchConfig]:
    """Configurations from method names (`ngram`, or `ngram:k4` for one K) and a list of K.

    Without a K list each method runs at the default K and is labelled by its name; with one,
    each speculative method runs once per K, labelled `method:kK`. `off` always runs, first.
    Example: methods ["ngram", "draft:k2"], K [2, 4] -> off, ngram:k2, ngram:k4, draft:k2.
    """
    configs = [BenchConfig(BASELINE, BASELINE, 0)]
    for entry in methods:
        entry = entry.strip()
        if not entry:
            continue
        name, _, k_part = entry.partition(":")
        if name not in method_names():
            raise SpecdecError(f"unknown method {name!r} in --methods; choose from {', '.join(method_names())}.")
        if name == BASELINE:
            continue
        if k_part:
            if not (k_part.startswith("k") and k_part[1:].isdigit()):
                raise SpecdecError(f"bad configuration {entry!r}: write it as {name} or {name}:kK, e.g. {name}:k4.")
            pairs = [(f"{name}:{k_part}", int(k_part[1:]))]
        elif num_draft_tokens:
            pairs = [(f"{name}:k{k}", k) for k in num_draft_tokens]
        else:
            pairs = [(name, default_k)]
        for label, k in pairs:
            if not 1 <= k <= 32:
                raise SpecdecError(f"{label}: the number of draft tokens must be between 1 and 32.")
            if all(c.label != label for c in configs):
                configs.append(BenchConfig(label, name, k))
    return configs


def reset_between_generations(engine) -> None:
    """Forget everything a generation could carry into the next: cached prefixes and any
    cross-request state (an engine that learns across requests exposes
    `reset_cross_request_state()`, called here)."""
    engine.clear_cache()
    hook = getattr(engine, "reset_cross_request_state", None)
    if callable(hook):
        hook()


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first position where two token lists differ (a length counts), or None if equal."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def target_logit_margin(engine, prompt_ids: Sequence[int], off_tokens: Sequence[int], position: int) -> tuple[float, int]:
    """The target's top-1 minus top-2 logit, and its argmax, at output `position` of the off run.

    Evaluates prompt + off_tokens[:position] on a fresh sequence after clearing every cache.
    """
    reset_between_generations(engine)
    context = list(prompt_ids) + list(off_tokens[:position])
    sequence = CachedSequence(engine.target, 0)
    try:
        sequence.prefill(context[:-1])
        logits = np.asarray(sequence.extend([context[-1]])[-1], dtype=np.float64)  # [vocab]
    finally:
        sequence.clear()
    top2 = np.partition(logits, -2)[-2:]
    return float(top2[1] - top2[0]), int(np.argmax(logits))


def measuring_order(configs: Sequence[BenchConfig], repeat: int) -> list[BenchConfig]:
    """Given order on even repeats, reversed on odd ones (see the module's docstring)."""
    return list(configs) if repeat % 2 == 0 else list(reversed(configs))


def pending(prompts: Sequence[BenchPrompt], configs: Sequence[BenchConfig], repeats: int,
            records: RecordFile) -> list[tuple[BenchPrompt, int, BenchConfig]]:
    """The (prompt, repeat, configuration) not yet recorded, in measuring order."""
    return [
        (prompt, repeat, config)
        for prompt in prompts
        for repeat in range(repeats)
        for config in measuring_order(configs, repeat)
        if (prompt.id, config.label, repeat) not in records
    ]


class Runner:
    """Runs the plan, appending one record per (prompt, configuration, repeat). `engine` runs the
    configurations of source "specdec"; `compared` maps "specdec@BACKEND" to another engine."""

    def __init__(
        self,
        engine,
        configs: Sequence[BenchConfig],
        settings: BenchSettings,
        records: RecordFile,
        clock: Callable[[], float] = time.perf_counter,
        progress: bool = True,
        compared: Optional[dict] = None,
    ):
        if not configs or configs[0].label != BASELINE:
            raise ValueError("the first configuration must be the baseline `off`")
        self.engines = {SOURCE: engine, **(compared or {})}
        if any(config.source not in self.engines for config in configs):
            raise ValueError("a configuration's source has no engine")
        self.engine = engine
        self.configs = list(configs)
        self.settings = settings
        self.records = records
        self.clock = clock
        self.progress = progress
        self._prompts: list[BenchPrompt] = []
        self._encoded: dict[tuple[str, str], object] = {}  # (source, prompt id) -> token ids or the error

    def run(self, prompts: Sequence[BenchPrompt]) -> dict:
        todo = pending(prompts, self.configs, self.settings.repeats, self.records)
        counts = {"planned": len(prompts) * self.settings.repeats * len(self.configs),
                  "measured": 0, "failed": 0, "skipped": 0}
        counts["skipped"] = counts["planned"] - len(todo)
        if not todo:
            return counts
        for source, engine in self.engines.items():
            if engine.cost_model is None and any(calibrated(c.method) and c.source == source for c in self.configs):
                engine.calibrate()  # before any timed generation: `auto` would otherwise calibrate inside one
        self.warm_up(prompts)
        from tqdm import tqdm

        self._prompts = list(prompts)
        encoded = self._encoded
        waiting_for_off: list[tuple[dict, BenchPrompt, object]] = []  # measured before off of their (prompt, repeat)
        with tqdm(total=len(todo), unit="gen", desc="bench", file=sys.stderr, disable=not self.progress,
                  dynamic_ncols=True) as bar:
            for prompt, repeat, config in todo:
                bar.set_postfix_str(f"{prompt.category}/{prompt.id} {config.label} r{repeat}", refresh=False)
                key = (config.source, prompt.id)  # engines may tokenize differently
                if key not in encoded:
                    encoded[key] = self._encode(prompt, self.engines[config.source])
                record = self.measure(prompt, encoded[key], config, repeat)
                self._record(record, config, prompt, encoded[key], waiting_for_off)
                counts["measured"] += 1
                if not record["success"]:
                    counts["failed"] += 1
                    bar.write(f"prompt {prompt.id}, {config.label}, repeat {repeat} failed: {record['error']}",
                              file=sys.stderr)
                bar.update(1)
        for _, record, _, _, _ in waiting_for_off:  # only if off itself was never measured: nothing to compare with
            self.records.append(record)
        return counts

    def _record(self, record: dict, config: BenchConfig, prompt: BenchPrompt, prompt_ids, waiting_for_off: list) -> None:
        """Write `record`, compared with its off first; one measured before that off waits for it."""
        key = (prompt.id, record["repeat"], config.baseline)
        if record["config"] == config.baseline:
            self.records.append(record)
            ready = [item for item in waiting_for_off if item[0] == key]
            waiting_for_off[:] = [item for item in waiting_for_off if item[0] != key]
        elif record["success"] and self.settings.greedy and \
                self.records.find((prompt.id, config.baseline, record["repeat"])) is None:
            waiting_for_off.append((key, record, config, prompt, prompt_ids))
            return
        else:
            ready = [(key, record, config, prompt, prompt_ids)]
        for _, waiting, its_config, its_prompt, its_ids in ready:
            if waiting["success"]:
                self._compare_with_off(waiting, its_config, its_prompt, its_ids, waiting["repeat"])
            self.records.append(waiting)

    # -- one generation ----------------------------------------------------------------------
    def _encode(self, prompt: BenchPrompt, engine):
        try:
            return list(engine.encode_prompt(list(prompt.messages), chat=True))
        except Exception as exc:  # recorded with every configuration of this prompt
            return exc

    def request(self, prompt_ids: Sequence[int], config: BenchConfig, repeat: int, max_tokens: int) -> GenerationRequest:
        seed = None if self.settings.greedy else self.settings.seed + repeat
        return GenerationRequest(
            prompt_token_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=self.settings.temperature, seed=seed),
            spec=SpecConfig(config.method, config.num_draft_tokens),
        )

    def measure(self, prompt: BenchPrompt, prompt_ids, config: BenchConfig, repeat: int) -> dict:
        identity = {"source": config.source, "prompt_id": prompt.id, "category": prompt.category,
                    "config": config.label, "method": config.method, "num_draft_tokens": config.num_draft_tokens,
                    "repeat": repeat, "matches_off": None, "order": measuring_order(self.configs, repeat).index(config)}
        started_at = time.time()
        if isinstance(prompt_ids, Exception):
            measured = RequestRecord(error=f"encoding the prompt failed: {type(prompt_ids).__name__}: {prompt_ids}")
        else:
            measured = self.timed_generation(prompt, prompt_ids, config, repeat)
        return bench_record(measured, identity, started_at)

    def timed_generation(self, prompt: BenchPrompt, prompt_ids: Sequence[int], config: BenchConfig, repeat: int) -> RequestRecord:
        """One timed generation from a clean engine; a failure is a record with its error."""
        engine = self.engines[config.source]
        try:
            request = self.request(prompt_ids, config, repeat, self.settings.max_tokens)
            reset_between_generations(engine)
            if self.settings.tenant_history:
                self.give_history(engine, prompt, config, repeat)
            started = self.clock()
            result = engine.generate(request)
            wall_seconds = self.clock() - started
        except Exception as exc:
            return RequestRecord(prompt_tokens=len(prompt_ids), error=f"{type(exc).__name__}: {exc}")
        stats = dict(result.stats)
        return RequestRecord(text=result.text, completion_tokens=len(result.token_ids), prompt_tokens=len(prompt_ids),
                             finish_reason=result.finish_reason, wall_seconds=wall_seconds,
                             ttft_seconds=stats.get("ttft_seconds"), decode_tokens_per_second=stats.get("tokens_per_second"),
                             stats=stats, fields={"output_token_ids": list(result.token_ids)})

    def give_history(self, engine, prompt: BenchPrompt, config: BenchConfig, repeat: int) -> None:
        """Fill the (anonymous) tenant's cross-request history with the prompts measured before this
        one in the run and what `off` generated for them in this repeat, oldest first: what a server
        would have seen from one tenant sending these prompts in order. Never this prompt's own text
        from another repeat or configuration, so no generation drafts from its own earlier answer."""
        history = engine.cross_request.for_tenant(None)
        for earlier in self._prompts[:self._prompts.index(prompt)]:
            key = (config.source, earlier.id)
            if key not in self._encoded:  # measured before a resume
                self._encoded[key] = self._encode(earlier, engine)
            prompt_ids = self._encoded[key]
            off = self.records.find((earlier.id, config.baseline, repeat))
            if isinstance(prompt_ids, list) and off is not None and off.get("success"):
                history.add(prompt_ids + list(off["output_token_ids"]))

    def _compare_with_off(self, record: dict, config: BenchConfig, prompt: BenchPrompt, prompt_ids, repeat: int) -> None:
        off = self.records.find((prompt.id, config.baseline, repeat))
        if off is None or not off.get("success") or not self.settings.greedy:
            return  # equality is only meaningful against a successful greedy baseline
        off_tokens = off["output_token_ids"]
        position = first_difference(off_tokens, record["output_token_ids"])
        record["matches_off"] = position is None
        if position is None:
            return
        record["first_diff_position"] = position
        record["off_token"] = off_tokens[position] if position < len(off_tokens) else None  # None: off stopped
        tokens = record["output_token_ids"]
        record["token"] = tokens[position] if position < len(tokens) else None
        try:
            margin, argmax = target_logit_margin(self.engines[config.source], prompt_ids, off_tokens, position)
            record["target_logit_margin"] = margin
            record["target_argmax_at_diff"] = argmax
        except Exception as exc:
            record["target_logit_margin"] = None
            record["margin_error"] = f"{type(exc).__name__}: {exc}"

    def warm_up(self, prompts: Sequence[BenchPrompt]) -> None:
        """Run each configuration `warmup` times, unrecorded, on short generations."""
        for i in range(self.settings.warmup):
            prompt = prompts[i % len(prompts)]
            for config in self.configs:
                engine = self.engines[config.source]
                prompt_ids = self._encode(prompt, engine)
                if isinstance(prompt_ids, Exception):
                    continue
                try:
                    reset_between_generations(engine)
                    max_tokens = min(self.settings.max_tokens, WARMUP_MAX_TOKENS)
                    engine.generate(self.request(prompt_ids, config, 0, max_tokens))
                except Exception as exc:
                    log.warning("warm-up of %s failed: %s", config.label, exc)
