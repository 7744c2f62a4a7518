"""The context each slot gets: the model's trained length, within a KV memory budget that fits the machine.

A llama.cpp-family library allocates (and zeroes, so it is resident) the whole KV cache when its
context is made: ik_llama.cpp one cache of n_ctx x slots cells (specdec's build), or one of n_ctx
cells per slot (the other ik configurations, and always the draft); mainline one stream of n_ctx
cells per slot. Each cell of a model holds K and V of every layer: n_layer x n_head_kv x
(key_length + value_length) elements of 2 bytes (f16, the libraries' default). The target and the
draft hold a cell per position each, so a slot's context costs both models' bytes per token.

    budget    = max(0, min(total RAM x 1/3, available RAM - the models' weights - 1 GiB))
    per slot  = min(trained length, budget / (slots x bytes per token of both) rounded down to 4,096)
                (auto), and never below min(trained, 4,096), the former fixed default;
    explicit  = --ctx-size N as given; refused (one line) above the trained length, or where its
                KV would not fit the memory available at all (available - weights - 1 GiB); past
                the budget's third of the RAM it is allowed, with a warning.

Attention spans only the cells in use (the libraries size each step's KV view by the highest used
cell), so a larger cache costs memory and start-up time, not decoding time (docs/usage.md,
"Context"). Everything here is pure but `kv_shape` (reads a GGUF header or a Hugging Face config)
and `machine_memory` (reads /proc/meminfo and the cgroup's limit).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from specdec.types import SpecdecError

MIB = 1 << 20
GIB = 1 << 30
# A size the budget limits is rounded down to whole 4,096 tokens: whole 256-cell blocks
# (backends/cell_blocks.py; mainline pads to 256), and few distinct sizes as the free memory moves
# (`auto`'s cost model is saved per setup, context included: machine_profile.setup_key).
ROUND = 4096
RAM_SHARE = 1 / 3  # the most of the machine's RAM an automatic KV cache takes
MARGIN = 1 * GIB  # beside the weights: compute buffers, the process, the page cache's breath
FLOOR = 4096  # the former fixed default: auto never gives less (where the model was trained for that)
KV_BYTES = 2  # f16 K and V, both libraries' default cache type


@dataclass(frozen=True)
class KvShape:
    """What one model's context costs: its trained length and the KV bytes of one position."""

    trained: int  # tokens, GGUF `{arch}.context_length` (0: unknown)
    bytes_per_token: int  # K and V of every layer


@dataclass(frozen=True)
class Memory:
    total: int  # bytes this process may use at most (RAM, or the cgroup's limit)
    available: int  # bytes it may take now without swapping (MemAvailable, within the cgroup)


@dataclass(frozen=True)
class ContextPlan:
    """The context per slot and how it was reached; `line()` is the start-up log's."""

    per_slot: int
    slots: int
    trained: Optional[int]  # None: unknown (no readable metadata)
    budget: int  # bytes the KV caches may take
    bytes_per_token: int  # both models together (0: unknown)
    weights: int
    memory: Memory
    explicit: bool
    reason: str  # what set per_slot: "trained", "budget", "floor", "explicit", "unknown"
    warning: Optional[str] = None

    @property
    def total(self) -> int:
        return self.per_slot * self.slots

    @property
    def kv_bytes(self) -> int:
        return self.total * self.bytes_per_token

    def line(self) -> str:
        trained = f"{self.trained:,}" if self.trained else "unknown"
        how = {"trained": "the trained length", "budget": "what the budget holds", "floor": "the floor of 4,096",
               "explicit": "--ctx-size", "unknown": "the fallback (no model metadata)"}[self.reason]
        kv = f"{self.kv_bytes / MIB:,.0f} MiB of KV at {self.bytes_per_token / 1024:,.1f} KiB a token" \
            if self.bytes_per_token else "KV size unknown"
        return (f"context: trained {trained} tokens; KV budget {self.budget / MIB:,.0f} MiB "
                f"(min of {RAM_SHARE:.2g} x {self.memory.total / GIB:.1f} GiB RAM, {self.memory.available / GIB:.1f} GiB "
                f"available - {self.weights / GIB:.1f} GiB weights - {MARGIN / GIB:.0f} GiB); "
                f"{self.per_slot:,} tokens a slot ({how}) x {self.slots} slots = {self.total:,} tokens, {kv}")


def kv_budget(memory: Memory, weights: int, share: float = RAM_SHARE, margin: int = MARGIN) -> int:
    """The bytes an automatic KV cache may take: a share of the RAM, within what is available
    beside the weights and a margin."""
    return max(0, min(int(memory.total * share), memory.available - weights - margin))


def plan_context(requested: Optional[int], *, slots: int, shapes: Sequence[KvShape], weights: int,
                 memory: Memory) -> ContextPlan:
    """The context per slot for `requested` (None: auto) with `slots` slots over models of `shapes`
    (the target first, then the draft where one is loaded). Raises SpecdecError (one line) for an
    explicit size beyond the trained length or the available memory."""
    trained = min((shape.trained for shape in shapes if shape.trained), default=0) or None
    per_token = sum(shape.bytes_per_token for shape in shapes) if all(s.bytes_per_token for s in shapes) else 0
    budget = kv_budget(memory, weights)

    def made(per_slot: int, reason: str, warning: Optional[str] = None) -> ContextPlan:
        return ContextPlan(per_slot, slots, trained, budget, per_token, weights, memory, requested is not None,
                           reason, warning)

    if requested is not None:
        if trained and requested > trained:
            raise SpecdecError(f"--ctx-size {requested:,} exceeds the {trained:,} tokens the model was trained for; "
                               f"give at most {trained:,}, or leave it out (auto).")
        need, room = requested * slots * per_token, max(0, memory.available - weights - MARGIN)
        if need > room:
            raise SpecdecError(f"--ctx-size {requested:,} x {slots} slots needs {need / MIB:,.0f} MiB of KV cache but "
                               f"only {room / MIB:,.0f} MiB of memory are available beside the weights; give at most "
                               f"{room // (slots * per_token):,}, fewer --parallel slots, or leave it out (auto).")
        if need > budget:
            return made(requested, "explicit", f"--ctx-size {requested:,} x {slots} slots takes {need / MIB:,.0f} MiB of "
                                               f"KV cache, more than the automatic budget of {budget / MIB:,.0f} MiB")
        return made(requested, "explicit")
    if not trained or not per_token:
        return made(FLOOR, "unknown")
    holds = budget // (slots * per_token)
    fits = holds // ROUND * ROUND
    floor = min(trained, FLOOR)
    if fits >= trained:
        return made(trained, "trained")
    if fits >= floor:
        return made(fits, "budget")
    return made(floor, "floor", f"the KV budget of {budget / MIB:,.0f} MiB holds {holds:,} tokens a slot for {slots} "
                                f"slots; taking the floor of {floor:,} (fewer --parallel slots or more free memory "
                                "would fit the budget)")


# -- the machine ------------------------------------------------------------------------------
def parse_meminfo(text: str) -> Memory:
    """/proc/meminfo's MemTotal and MemAvailable (kB)."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name.strip()] = int(parts[0]) * 1024
    if "MemTotal" not in values:
        raise ValueError("no MemTotal in /proc/meminfo")
    total = values["MemTotal"]
    return Memory(total, values.get("MemAvailable", values.get("MemFree", total)))


def within_cgroup(memory: Memory, limit: Optional[int], current: Optional[int]) -> Memory:
    """A cgroup v2 limit (memory.max) and usage (memory.current) bound what the process may take."""
    if limit is None:
        return memory
    total = min(memory.total, limit)
    available = memory.available if current is None else min(memory.available, max(0, limit - current))
    return Memory(total, min(available, total))


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def machine_memory(proc: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> Memory:
    """What this process may use: /proc/meminfo within the cgroup's limit (elsewhere: the physical
    memory, all of it taken as available)."""
    try:
        memory = parse_meminfo(proc.read_text())
    except (OSError, ValueError):
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = Memory(total, total)
    return within_cgroup(memory, _read_int(cgroup / "memory.max"), _read_int(cgroup / "memory.current"))


# -- the models -------------------------------------------------------------------------------
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path) -> dict[str, object]:
    """A GGUF file's key-value metadata: scalars and strings, and arrays of numbers as lists
    (arrays of strings, the tokenizer's, are skipped). Reads the header only."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = struct.unpack_from("<I", data, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here")
        n_kv = struct.unpack_from("<Q", data, 16)[0]
        offset, out = 24, {}

        def string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", data, at)
            return data[at + 8:at + 8 + length].decode("utf-8", errors="replace"), at + 8 + length

        def value(kind: int, at: int) -> tuple[object, int]:
            if kind in _SCALARS:
                fmt = _SCALARS[kind]
                return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
            if kind == _STRING:
                return string(at)
            if kind == _ARRAY:
                inner, count = struct.unpack_from("<IQ", data, at)
                at += 12
                if inner in _SCALARS:
                    size = struct.calcsize(_SCALARS[inner])
                    items = list(struct.unpack_from(f"<{count}{_SCALARS[inner][1]}", data, at)) if count < 1 << 16 else None
                    return items, at + count * size
                if inner == _STRING:
                    for _ in range(count):
                        at += 8 + struct.unpack_from("<Q", data, at)[0]
                    return None, at
                raise ValueError(f"{path}: nested GGUF arrays are not read here")
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        for _ in range(n_kv):
            key, offset = string(offset)
            (kind,) = struct.unpack_from("<I", data, offset)
            item, offset = value(kind, offset + 4)
            if item is not None:
                out[key] = item
        return out


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"not a number: {value!r}")
    return int(value)


def _per_layer(value: object, n_layer: int) -> list[int]:
    """A per-layer value: one number for every layer, or a list of them."""
    if isinstance(value, list):
        return [_int(v) for v in value[:n_layer]]
    return [_int(value)] * n_layer


def shape_from_gguf(meta: Mapping[str, object]) -> KvShape:
    """KvShape from GGUF metadata: {arch}.context_length, .block_count, .attention.head_count(_kv),
    .embedding_length and, where given, .attention.key_length / value_length (as llama.cpp reads them)."""
    arch = str(meta["general.architecture"])

    def get(name: str, default: object = None) -> object:
        item = meta.get(f"{arch}.{name}", default)
        if item is None:
            raise KeyError(f"{arch}.{name}")
        return item

    n_layer = _int(get("block_count"))
    heads = _per_layer(get("attention.head_count"), n_layer)
    heads_kv = _per_layer(get("attention.head_count_kv", heads), n_layer)
    widest: int = max(heads, default=0)
    head_dim = _int(get("embedding_length")) // widest if widest else 0
    key, val = _int(get("attention.key_length", head_dim)), _int(get("attention.value_length", head_dim))
    return KvShape(_int(get("context_length")), sum(heads_kv) * (key + val) * KV_BYTES)


def shape_from_hf_config(config: Mapping[str, object], dtype_bytes: int = 2) -> KvShape:
    """KvShape from a Hugging Face config.json (the torch backend's model folders)."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        config = text
    n_layer, heads = _int(config["num_hidden_layers"]), _int(config["num_attention_heads"])
    heads_kv = _int(config.get("num_key_value_heads") or heads)
    head_dim = _int(config.get("head_dim") or _int(config["hidden_size"]) // heads)
    return KvShape(_int(config.get("max_position_embeddings") or 0), n_layer * heads_kv * 2 * head_dim * dtype_bytes)


def kv_shape(path: Path, dtype_bytes: int = KV_BYTES) -> Optional[KvShape]:
    """The model's KvShape from its GGUF header (or a model folder's config.json), its cache in
    elements of `dtype_bytes`; None where neither can be read (the backend then says what is wrong
    with the file)."""
    try:
        if path.is_dir():
            return shape_from_hf_config(json.loads((path / "config.json").read_text()), dtype_bytes)
        shape = shape_from_gguf(gguf_metadata(path))
        return KvShape(shape.trained, shape.bytes_per_token // KV_BYTES * dtype_bytes)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def weights_bytes(path: Path) -> int:
    """The bytes a model's weights take in memory: its file (a folder's files)."""
    try:
        if path.is_dir():
            return sum(each.stat().st_size for each in path.iterdir() if each.suffix in (".safetensors", ".bin"))
        return path.stat().st_size
    except OSError:
        return 0
