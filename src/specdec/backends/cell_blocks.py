"""Where each sequence's positions sit in a KV cache that several sequences share.

Attention sums a sequence's cells in SIMD groups and blocks that follow the cell index; the other
sequences' cells are masked to exact zeros. So a sequence sums as it would alone (its positions
at cells 0, 1, 2, ...) as long as its cells keep their order and their offsets within every
aligned block: here each sequence takes whole blocks of BLOCK cells (a multiple of every SIMD
width), position p in its (p // BLOCK)-th block at offset p % BLOCK, and its blocks in
increasing cell order. Blocks are taken lowest first, so the cells in use stay low and a call's
attention spans little more than its own sequences' cells (docs/exactness.md, "Streams sharing
a forward").

Example (BLOCK 4, 12 cells): A takes blocks 0 and 1 for positions 0..5 (cells 0..5), B then
block 2 (cells 8..); A's positions 8.. need a block above 1: block 2 is B's, so none is free.

Sequences with a common prompt start share its blocks (share(): the cells hold the same
positions, so each still sums as alone); a block is free again when its last holder drops it. A
sequence writes only into blocks it holds alone (cells() refuses the others), so no holder may
cut into a shared block and write there (keepable() says where a cut may fall). A start that ends
inside a block shares that block too, the cells past the start free: a holder that never writes
(a parked prompt start, engine/prompt_cache.py) may keep it, and whoever writes after the start
there does so once the other holders have dropped it.

A sequence's attention spans its cells from its first block to its last, other sequences' blocks
between them included (masked, but still read): a conversation that takes back its parked blocks
low in the cache and grows above other parked conversations pays for all of them at every step.
gathered() finds a run of free blocks where it fits whole, and move_to() puts it there (the
backend copies the cells over): offsets within blocks unchanged, so it sums as before.
"""
from __future__ import annotations

import bisect
from typing import Optional, Sequence

from specdec.types import SpecdecError

BLOCK = 256


class CellBlocks:
    def __init__(self, n_cells: int, block: int = BLOCK):
        self.block = block
        self._count = n_cells // block
        self._free = list(range(n_cells // block))  # sorted
        self._blocks: dict[int, list[int]] = {}  # sequence -> its blocks, increasing
        self._holders: dict[int, int] = {}  # block -> how many sequences hold it

    def cells(self, seq: int, positions: Sequence[int]) -> list[int]:
        """The cell of each position `seq` is about to write, taking blocks as the positions need
        them; never in a block another sequence holds."""
        blocks = self._blocks.setdefault(seq, [])
        out = []
        for position in positions:
            index, offset = divmod(position, self.block)
            while len(blocks) <= index:
                blocks.append(self._take_above(blocks[-1] if blocks else -1, seq))
            if self._holders[blocks[index]] > 1:
                raise ValueError(f"sequence {seq} would write position {position} into block {blocks[index]}, "
                                 "which another sequence holds")
            out.append(blocks[index] * self.block + offset)
        return out

    def held_cells(self, seq: int, length: int) -> list[int]:
        """The cells of `seq`'s positions < length, which it holds (alone or shared)."""
        blocks = self._blocks.get(seq, [])
        if len(blocks) * self.block < length:
            raise ValueError(f"sequence {seq} holds fewer than {length} positions")
        return [blocks[position // self.block] * self.block + position % self.block for position in range(length)]

    def first_cell(self, seq: int) -> int:
        """The first cell of the sequence's first block (a call's attention starts at its sequences' lowest)."""
        return self._blocks[seq][0] * self.block

    def share(self, source: int, seq: int, length: int) -> None:
        """`seq` (holding nothing) takes `source`'s positions < length: the blocks that hold them,
        the last one in part where `length` is no multiple of the block."""
        if self._blocks.get(seq):
            raise ValueError(f"sequence {seq} can share positions only while it holds none")
        count = -(-length // self.block)
        shared = self._blocks.get(source, [])[:count]
        if len(shared) != count:
            raise ValueError(f"sequence {source} holds fewer than {length} positions")
        for block in shared:
            self._holders[block] += 1
        self._blocks[seq] = list(shared)

    def room(self, seq: int, end: int) -> bool:
        """Whether `seq` can take blocks for its positions < end: enough free ones above its last."""
        return self.room_to_hold(seq, seq, len(self._blocks.get(seq, [])) * self.block, end)

    def room_to_hold(self, seq: int, source: int, length: int, end: int) -> bool:
        """Whether `seq`, holding `source`'s positions < length in place of what it holds now (its
        own when source is seq), could take blocks for its positions < end: enough free ones above
        the last it would hold, counting those it would give up."""
        kept = self._blocks.get(source, [])[:-(-length // self.block)]
        lacking = -(-end // self.block) - len(kept)
        if lacking <= 0:
            return True
        last = kept[-1] if kept else -1
        given_up = [block for block in self._blocks.get(seq, [])
                    if block > last and block not in kept and self._holders[block] == 1]
        return len(self._free) - bisect.bisect_right(self._free, last) + len(given_up) >= lacking

    def keepable(self, seq: int, length: int) -> int:
        """The longest prefix up to `length` that `seq` may keep and write after: never part of a
        block it shares (the positions after the cut sit in cells another sequence still holds)."""
        blocks = self._blocks.get(seq, [])
        index = length // self.block
        if length % self.block and index < len(blocks) and self._holders[blocks[index]] > 1:
            return index * self.block
        return length

    def truncate(self, seq: int, length: int) -> None:
        """`seq` keeps positions < length: the blocks wholly past them that no other sequence holds
        are free again."""
        blocks = self._blocks.get(seq, [])
        keep = -(-length // self.block)
        for block in blocks[keep:]:
            self._holders[block] -= 1
            if not self._holders[block]:
                del self._holders[block]
                bisect.insort(self._free, block)
        del blocks[keep:]

    def gathered(self, seq: int, length: int, end: int) -> Optional[list[int]]:
        """Blocks of one run where `seq`'s positions < length could move, with free blocks after
        them for its positions < end: the lowest run of free blocks (its own counted) that fits
        `end`, else the longest that leaves it as much room; None where it already sits in such a
        run or none sits better, and where it shares a block (the other holder reads it there)."""
        blocks = self._blocks.get(seq, [])
        held = -(-length // self.block)
        if not held or any(self._holders[block] > 1 for block in blocks):
            return None
        need = max(held, min(-(-end // self.block), self._count))
        available = sorted(set(self._free) | set(blocks))
        runs: list[tuple[int, int]] = []  # (first block, how many) of consecutive available blocks
        for block in available:
            if runs and runs[-1][0] + runs[-1][1] == block:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((block, 1))
        # The run its cells may use now: from its first block, where its positions lie in order.
        now = next((first + count - blocks[0] for first, count in runs if first <= blocks[0] < first + count), 0) \
            if blocks[:held] == list(range(blocks[0], blocks[0] + held)) else 0
        if now >= need:
            return None

        def room(first: int) -> int:  # the blocks it could hold from `first` on: it takes them above its last
            return len(available) - bisect.bisect_left(available, first)

        has = held + room(blocks[held - 1] + 1)
        options = [(first, count) for first, count in runs if count >= held and room(first) >= min(need, has)]
        if not options:
            return None
        fitting = [option for option in options if option[1] >= need]
        first, count = fitting[0] if fitting else max(options, key=lambda option: option[1])
        moved = list(range(first, first + held))
        return moved if count > now and moved != blocks[:held] else None

    def move_to(self, seq: int, blocks: list[int]) -> list[int]:
        """`seq` holds `blocks` (from gathered()) in place of its own, its positions in the same
        order; the cells its positions < len(blocks) * block now take."""
        self.truncate(seq, 0)
        for block in blocks:
            self._free.remove(block)
            self._holders[block] = 1
        self._blocks[seq] = list(blocks)
        return self.held_cells(seq, len(blocks) * self.block)

    def _take_above(self, last: int, seq: int) -> int:
        at = bisect.bisect_right(self._free, last)
        if at == len(self._free):
            raise SpecdecError(f"the shared KV cache has no free block after sequence {seq}'s last one "
                               f"({len(self._free)} free below it): serve fewer concurrent long sequences "
                               "or give each a smaller --ctx-size.")
        block = self._free.pop(at)
        self._holders[block] = 1
        return block
