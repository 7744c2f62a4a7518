"""Prompt starts kept in the KV cache after their slot moved on to another conversation.

With more live conversations than slots (a support bot's users, several agent sessions), a
slot given to another request used to lose what it held, and the conversation's next turn was
processed again from its first token. Where the backend lets sequences share cached positions
(specdec's ik_llama.cpp build: cell_blocks.py), a slot's prompt start is parked instead: a
spare sequence id takes the cells of all the slot would have kept for a later prompt, its last
block in part (no copy, the cells get a second owner; the slot drops them as the new request
takes it), and a later request of the same tenant whose prompt starts with those tokens adopts
them as if its slot had waited for it, processing only the rest. A request that takes all of a
start's reusable positions takes its blocks over (the start is no longer parked: the slot holds
it, and parks it again as it moves on); one whose prompt diverges earlier takes the whole blocks
before the divergence, shared, and leaves the start parked as it was. The cells are the ones
computed for the first prompt, so a restored start is bit-identical to the same start processed
again. A start taken over, or loaded, that lies among other sequences' blocks moves into blocks
that lie together (EngineCore._gather): its attention would read past the others at every step.

Parked starts hold cells no running sequence uses; a sequence that needs cells gets them first:
the least recently used parked start is dropped until it has room (EngineCore._make_room), as is
one when every spare id is taken. A request about to adopt a start checks first that it will have
room above its blocks, the others dropped if need be (EngineCore._room_to_hold). Never across
tenants: a start is found only for its own tenant.

A start that gives way is copied to host memory first where the backend can copy its cells out
(specdec's ik build: save_positions), within a bound of bytes (`--cache-ram`, least recently used
dropped first), and a later prompt of its tenant that it serves loads it into cells of its own
(load_positions): the values computed for the first prompt, so bit-identical to processing it
again. What gives way only for a longer start of its own tenant is not copied.

The draft model's sequences are copied to host memory too (a PromptCache of the draft's, with no
parked ids: Engine.draft_copies) when their slot moves to another conversation, within a quarter
of the bound, and loaded when the conversation comes back, so its proposals need no catch-up on a
long prompt. Not parked in cells (its forwards would then have to make room as the target's
prefill does) and not written across restarts: a draft lacking its copy only proposes later.

With a folder to keep them in (`--prompt-cache-dir`), a server that stops writes there copies of
all it holds (the slots' conversations, the parked starts and the copies), and a server started
later on the same machine, models and build reads them back into host memory.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar, Union

import numpy as np

from specdec.backends.base import Backend
from specdec.backends.context_size import GIB, Memory
from specdec.backends.sequence import CachedSequence, SavedSequence

logger = logging.getLogger(__name__)

HOST_SHARE = 1 / 8  # of the machine's RAM, by default, for starts copied to host memory
HOST_MOST = 8 * GIB  # and at most this (llama-server's --cache-ram default)
# Of that bound, what copies of the draft model's sequences may take (the default pair's draft
# cells are 0.43x the target's: 12 and 28 KiB a position).
DRAFT_HOST_SHARE = 1 / 4


def default_host_bytes(memory: Memory) -> int:
    """The host memory copies of parked starts may take when `--cache-ram` is not given."""
    return int(min(HOST_MOST, memory.total * HOST_SHARE))


@dataclass
class Parked:
    sequence: CachedSequence
    tenant: Optional[str]
    used: int  # a tick of the cache's own clock: larger is more recent


@dataclass
class Saved:
    sequence: SavedSequence  # a parked start's copy in host memory
    tenant: Optional[str]
    used: int


@dataclass
class PromptCacheStats:
    parked: int = 0  # starts parked
    hits: int = 0  # requests that adopted a parked start or loaded a saved one
    tokens_restored: int = 0  # prompt tokens those requests did not process again
    evicted: int = 0  # starts dropped for room or for a spare id
    saved: int = 0  # starts copied to host memory as they gave way
    host_hits: int = 0  # requests that loaded one (counted in hits too)
    host_tokens_restored: int = 0  # prompt tokens they loaded
    host_evicted: int = 0  # copies dropped for the bound
    host_failed: int = 0  # copies that did not load (dropped; their requests processed the prompt)
    gathered: int = 0  # restored starts moved into cells that lie together (EngineCore._gather)


class PromptCache:
    def __init__(self, backend: Backend, first_id: int, capacity: int, host_bytes: int = 0):
        self.backend = backend
        self.capacity = capacity  # starts parked at most
        self._free_ids = list(range(first_id, first_id + capacity))
        self._entries: list[Parked] = []
        self.host_bytes = host_bytes  # the bound on copies in host memory (0: none kept)
        self._saved: list[Saved] = []
        self._tick: Callable[[], int] = itertools.count(1).__next__
        self.stats = PromptCacheStats()

    @property
    def saved_bytes(self) -> int:
        return sum(entry.sequence.cells.nbytes for entry in self._saved)

    @property
    def saved_count(self) -> int:
        return len(self._saved)

    @property
    def held_tokens(self) -> int:
        """Positions the parked starts hold (some may be shared with slots, or among them)."""
        return sum(len(entry.sequence.tokens) for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def park(self, source: CachedSequence, tenant: Optional[str]) -> None:
        """Keep the restorable start of what `source` holds, unless a parked start of the tenant
        already covers it (one it covers is dropped: the new one holds all of it and more)."""
        length = source.restorable()
        if not length:
            return
        covering, covered = _coverage(self._entries, tenant, source.tokens[:length])
        if covering is not None:
            covering.used = self._tick()
            return
        for entry in covered:
            self._drop(entry)
        if not self._free_ids:
            self.evict_one()
        if not self._free_ids:
            return
        sequence = CachedSequence(self.backend, self._free_ids.pop(), aligned_reuse=True)
        try:
            sequence.adopt(source, length)
        except BaseException:
            self._free_ids.append(sequence.seq_id)
            raise
        self._entries.append(Parked(sequence, tenant, self._tick()))
        self.stats.parked += 1

    def best(self, tenant: Optional[str], prompt: Sequence[int]) -> tuple[Union[Parked, Saved, None], int]:
        """The tenant's parked start that serves the longest start of `prompt`, and that length:
        all that its slot would have kept for `prompt` where that takes all the start's reusable
        positions, else the whole blocks of the common start (the rest stays parked); a copy in
        host memory only where it serves more (loading it copies, adopting does not)."""
        best: tuple[Union[Parked, Saved, None], int] = (None, 0)
        for entry in self._entries:
            if entry.tenant == tenant:
                length = entry.sequence.reusable_prefix(prompt)
                if length < entry.sequence.reusable_end:
                    length = entry.sequence.shareable_prefix(prompt)
                if length > best[1]:
                    best = (entry, length)
        for saved in self._saved:
            if saved.tenant == tenant:
                length = saved.sequence.reusable_prefix(prompt)
                if length > best[1]:
                    best = (saved, length)
        return best

    def restore(self, entry: Union[Parked, Saved], into: CachedSequence, length: int) -> int:
        """`into` takes the first `length` positions of `entry` (a length best() gave); how many it
        holds then. A parked start taken whole goes: into holds its blocks alone, writes its next
        positions in its last one, and may move them (Backend.gather); one taken in part keeps
        them shared. A copy in host memory is loaded into cells of into's own, and stays; one that
        does not load goes, and `into` is left empty (0): the request processes its prompt again."""
        entry.used = self._tick()
        if isinstance(entry, Saved):
            try:
                into.load(entry.sequence, length)
            except Exception:  # a copy that fails costs its reprocessing, never the request at hand
                logger.exception("could not load a prompt start from host memory; processing it again")
                into.clear()
                self._saved.remove(entry)
                self.stats.host_failed += 1
                return 0
            self._count_hit(length)
            self.stats.host_hits += 1
            self.stats.host_tokens_restored += length
            return length
        into.adopt(entry.sequence, length)
        self._count_hit(length)
        if length >= entry.sequence.reusable_end:
            self._drop(entry)  # into holds all it served, and is parked again as its slot moves on
        return length

    def _count_hit(self, length: int) -> None:
        self.stats.hits += 1
        self.stats.tokens_restored += length

    def evict_one(self, sparing: Optional[Parked] = None) -> bool:
        """Drop the least recently used parked start but `sparing` (one a request is about to
        adopt); False when none is left."""
        candidates = [entry for entry in self._entries if entry is not sparing]
        if not candidates:
            return False
        entry = min(candidates, key=lambda entry: entry.used)
        self._copy(entry.sequence, entry.tenant, entry.used)
        self._drop(entry)
        self.stats.evicted += 1
        return True

    def clear(self) -> None:
        for entry in list(self._entries):
            self._drop(entry)
        self._saved.clear()

    def copy(self, sequence: CachedSequence, tenant: Optional[str]) -> None:
        """A copy in host memory of what `sequence` holds, as the most recently used (_copy)."""
        self._copy(sequence, tenant, self._tick())

    def _copy(self, sequence: CachedSequence, tenant: Optional[str], used: int) -> None:
        """A copy of the start in host memory, unless one of its tenant's already covers it (one it
        covers goes), within the bound: the least recently used copies go first."""
        if not self.host_bytes:
            return
        covering, covered = _coverage(self._saved, tenant, sequence.tokens[:sequence.restorable()])
        if covering is not None:
            covering.used = max(covering.used, used)
            return
        for saved in covered:
            self._saved.remove(saved)
        try:
            copy = sequence.save()
        except Exception:  # a start not copied costs its reprocessing later, never the request at hand
            logger.exception("could not copy a prompt start to host memory")
            return
        if copy is not None:
            self._hold(Saved(copy, tenant, used))
            self.stats.saved += 1

    def _hold(self, saved: Saved) -> bool:
        """Keep `saved` within the bound, the least recently used copies dropped for it."""
        if saved.sequence.cells.nbytes > self.host_bytes:
            return False
        while self._saved and self.saved_bytes + saved.sequence.cells.nbytes > self.host_bytes:
            self._saved.remove(min(self._saved, key=lambda held: held.used))
            self.stats.host_evicted += 1
        self._saved.append(saved)
        return True

    # -- across restarts (--prompt-cache-dir) ----------------------------------------------------
    def copy_everything(self, slots: Sequence[tuple[CachedSequence, Optional[str]]]) -> None:
        """Copies of every parked start and of what the slots hold (the most recent), as at shutdown."""
        for entry in sorted(self._entries, key=lambda entry: entry.used):
            self._copy(entry.sequence, entry.tenant, entry.used)
        for sequence, tenant in slots:
            if sequence.tokens:
                self._copy(sequence, tenant, self._tick())

    def write(self, folder: Path) -> int:
        """The copies in host memory into `folder` (in place of what it held), least recently used
        first; how many."""
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for old in folder.glob("*.npz"):
            old.unlink()
        held = sorted(self._saved, key=lambda saved: saved.used)
        for index, saved in enumerate(held):
            copy = saved.sequence
            meta = {"tenant": saved.tenant, "alignment": copy.alignment, "whole_chunks_end": copy.whole_chunks_end,
                    "prefill_end": copy.prefill_end}
            with open(folder / f"{index:05d}.npz", "wb", opener=lambda path, flags: os.open(path, flags, 0o600)) as file:
                np.savez(file, cells=copy.cells, tokens=np.asarray(copy.tokens, dtype=np.int64),
                         meta=np.asarray(json.dumps(meta)))
        return len(held)

    def read(self, folder: Path) -> int:
        """Copies written by write() back into host memory, within the bound (the most recent kept);
        how many. A file that does not read as one is skipped."""
        loaded = 0
        for path in sorted(folder.glob("*.npz")):
            try:
                with np.load(path, allow_pickle=False) as data:
                    meta = json.loads(str(data["meta"]))
                    copy = SavedSequence(tuple(int(t) for t in data["tokens"]), int(meta["alignment"]),
                                         int(meta["whole_chunks_end"]), int(meta["prefill_end"]), data["cells"])
                tenant = meta["tenant"]
                if copy.cells.dtype != np.uint8 or not copy.tokens or copy.cells.nbytes % len(copy.tokens) \
                        or not (tenant is None or isinstance(tenant, str)):
                    raise ValueError("not a prompt start's copy")
            except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
                logger.warning("skipping %s: %s", path, exc)
                continue
            loaded += self._hold(Saved(copy, tenant, self._tick()))
        return loaded

    def _drop(self, entry: Parked) -> None:
        self._entries.remove(entry)
        try:
            entry.sequence.clear()  # its blocks are free again once no slot shares them
        finally:
            self._free_ids.append(entry.sequence.seq_id)


Entry = TypeVar("Entry", Parked, Saved)


def _coverage(entries: Sequence[Entry], tenant: Optional[str], tokens: Sequence[int]) -> tuple[Optional[Entry], list[Entry]]:
    """Among `tenant`'s entries: one whose tokens start with `tokens` (it covers them), else None,
    and those whose tokens `tokens` start with (they are covered: a start holding `tokens` serves
    all they serve)."""
    tokens = tuple(tokens)
    own = [entry for entry in entries if entry.tenant == tenant]
    covering = next((entry for entry in own if tuple(entry.sequence.tokens[:len(tokens)]) == tokens), None)
    if covering is not None:
        return covering, []
    return None, [entry for entry in own if tokens[:len(entry.sequence.tokens)] == tuple(entry.sequence.tokens)]
