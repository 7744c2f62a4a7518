"""A weightless backend for tests: deterministic pseudo-random logits over a small byte vocabulary.

The logits at a position depend on the two cached tokens before it (so greedy text falls into
repeating cycles that an n-gram drafter can exploit), and they are computed from the backend's own
record of the cache, so a cache that falls out of step with the engine changes the output.
A second instance with `noise > 0` plays a draft model that often, but not always, agrees.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

import numpy as np

from specdec.backends.base import Backend
from specdec.backends.cell_blocks import CellBlocks
from specdec.backends.chat_template import render_chat_template

SPECIAL_PIECES = [b"<|endoftext|>", b"<|im_end|>", b"<|im_start|>"]
WORD_PIECES = [b"the ", b"cat ", b"sat ", b"on ", b"mat", b"\xc3", b"\xa9"]  # 'é' is split over two tokens


class FakeBackend(Backend):
    name = "fake"

    def __init__(
        self,
        seed: int = 0,
        noise: float = 0.0,
        noise_seed: int = 1,
        n_ctx: int = 2048,
        max_sequences: int = 8,
        eog_bias: float = -4.0,
        sharpness: float = 3.0,
        clock=None,
        step_cost: float = 0.0,
        token_cost: float = 0.0,
        extra_special_pieces: Sequence[bytes] = (),
        chat_template: Optional[str] = None,
        prefix_share_block: int = 0,
        parked_sequences: int = 0,
        cell_bytes: int = 0,
    ):
        # Extra special pieces (e.g. FIM tokens) go last, so that every default id stays as it is.
        self.pieces: list[bytes] = (SPECIAL_PIECES + [bytes([b]) for b in range(32, 127)] + [b"\n"] + WORD_PIECES
                                    + list(extra_special_pieces))
        self._extra_special = frozenset(extra_special_pieces)
        self.chat_template = chat_template  # a Jinja chat template (a real model's) in place of the built-in one
        self.vocab_size = len(self.pieces)
        self.n_ctx = n_ctx
        self.max_sequences = max_sequences
        self.eog_token_ids = frozenset({0, 1})
        self.seed = seed
        self.noise = noise
        self.noise_seed = noise_seed
        self.eog_bias = eog_bias
        self.sharpness = sharpness
        self.cache: dict[int, list[int]] = {}
        self.eval_calls: list[tuple[int, int]] = []  # (seq_id, n_tokens) per eval, for tests
        self.shared_prefixes: list[tuple[int, int, int]] = []  # (source, seq_id, length) per share, for tests
        # An injected clock lets tests give each forward a known cost without wall-clock timing.
        self.clock = clock
        self.step_cost = step_cost
        self.token_cost = token_cost
        # Sharing cached positions between sequences, kept in blocks as the llama.cpp family keeps them.
        self.prefix_share_block = prefix_share_block
        self._blocks = CellBlocks(n_ctx * max_sequences, prefix_share_block) if prefix_share_block else None
        self.parked_sequences = parked_sequences if prefix_share_block else 0
        # > 0: a cell copied to host memory takes this many bytes (save_positions), as a real KV cell would
        self.cell_bytes = cell_bytes
        self.loads: list[tuple[int, int]] = []  # (seq_id, length) per load_positions, for tests
        self.gathers: list[tuple[int, int]] = []  # (seq_id, length) per gather that moved cells, for tests
        self._by_piece = {piece: i for i, piece in enumerate(self.pieces)}
        self._max_piece = max(len(p) for p in self.pieces)

    # -- tokenizer ---------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        ids, i = [], 0
        while i < len(data):
            for length in range(min(self._max_piece, len(data) - i), 0, -1):
                token = self._by_piece.get(data[i:i + length])
                # Extra special pieces honour parse_special (the default ones always parse, as before).
                if token is not None and (parse_special or data[i:i + length] not in self._extra_special):
                    ids.append(token)
                    i += length
                    break
            else:
                ids.append(self._by_piece[b"?"])  # bytes outside the fake vocabulary
                i += 1
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def chat_template_source(self) -> Optional[str]:
        return self.chat_template  # None: the built-in layout below, which is no Jinja text

    def apply_chat_template(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> str:
        if self.chat_template is not None:
            return render_chat_template(self.chat_template, messages, tools)
        # Qwen2.5's layout in brief: the tools as JSON lines in a system turn, calls as <tool_call> blocks.
        lines = "".join(f"{json.dumps(tool)}\n" for tool in tools or ())
        rendered = f"<|im_start|>system\n<tools>\n{lines}</tools><|im_end|>\n" if lines else ""
        for m in messages:
            calls = "".join(f'\n<tool_call>\n{{"name": "{call["function"]["name"]}", "arguments": '
                            f'{json.dumps(call["function"]["arguments"])}}}\n</tool_call>'
                            for call in m.get("tool_calls") or ())
            rendered += f"<|im_start|>{m['role']}\n{m['content'] or ''}{calls}<|im_end|>\n"
        return rendered + "<|im_start|>assistant\n"

    # -- model -------------------------------------------------------------------------------
    def _row(self, history: Sequence[int]) -> np.ndarray:
        a = history[-2] if len(history) >= 2 else -1
        b = history[-1] if history else -1
        key = (a + 1) * 1_000_003 + (b + 1)
        logits = np.random.default_rng([self.seed, key]).normal(size=self.vocab_size) * self.sharpness
        if self.noise:
            logits += np.random.default_rng([self.noise_seed, key]).normal(size=self.vocab_size) * self.noise * self.sharpness
        logits[list(self.eog_token_ids)] += self.eog_bias
        return logits.astype(np.float32)

    def eval(self, seq_id: int, start: int, tokens: Sequence[int], *, prefill: bool = False) -> np.ndarray:
        cache = self.cache.setdefault(seq_id, [])
        if start != len(cache):
            raise AssertionError(f"fake backend: eval at {start} but sequence {seq_id} caches {len(cache)} tokens")
        if start + len(tokens) > self.n_ctx:
            raise AssertionError("fake backend: context overflow")
        if self._blocks is not None:
            self._blocks.cells(seq_id, range(start, start + len(tokens)))
        rows = []
        for token in tokens:
            cache.append(int(token))
            rows.append(self._row(cache))
        self.eval_calls.append((seq_id, len(tokens)))
        if self.clock is not None:
            self.clock.advance(self.step_cost + self.token_cost * len(tokens))
        if prefill:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        return np.stack(rows) if rows else np.zeros((0, self.vocab_size), dtype=np.float32)

    def truncate(self, seq_id: int, length: int) -> None:
        if self._blocks is not None:
            if self._blocks.keepable(seq_id, length) != length:
                raise AssertionError(f"fake backend: sequence {seq_id} cut at {length}, inside a block it shares")
            self._blocks.truncate(seq_id, length)
        del self.cache.setdefault(seq_id, [])[length:]

    def share_prefix(self, source_seq: int, seq_id: int, length: int) -> None:
        if self._blocks is None:
            super().share_prefix(source_seq, seq_id, length)
        if self.cache.get(seq_id):
            raise AssertionError(f"fake backend: sequence {seq_id} shares a prefix while it holds tokens")
        self._blocks.share(source_seq, seq_id, length)
        self.cache[seq_id] = list(self.cache[source_seq][:length])
        self.shared_prefixes.append((source_seq, seq_id, length))

    @property
    def copies_cells(self) -> bool:
        return bool(self.cell_bytes)

    def save_positions(self, seq_id: int, length: int) -> Optional[np.ndarray]:
        if not self.cell_bytes:
            return None
        tokens = self.cache.get(seq_id, [])[:length]
        if len(tokens) != length:
            raise AssertionError(f"fake backend: sequence {seq_id} holds fewer than {length} positions")
        # Each cell's bytes carry its token, so a copy put back where it does not belong shows.
        cells = np.zeros((length, self.cell_bytes), dtype=np.uint8)
        cells[:, :4] = np.asarray(tokens, dtype="<u4").view(np.uint8).reshape(length, 4)
        return cells.reshape(-1)

    def load_positions(self, seq_id: int, cells: np.ndarray, length: int) -> None:
        if self.cache.get(seq_id):
            raise AssertionError(f"fake backend: sequence {seq_id} loads positions while it holds tokens")
        rows = cells.reshape(-1, self.cell_bytes)[:length]
        if self._blocks is not None:
            self._blocks.cells(seq_id, range(length))
        self.cache[seq_id] = [int(t) for t in np.ascontiguousarray(rows[:, :4]).view("<u4").reshape(-1)]
        self.loads.append((seq_id, length))

    def gather(self, seq_id: int, length: int, end: int) -> bool:
        if self._blocks is None or not self.cell_bytes or length <= 0:
            return False
        blocks = self._blocks.gathered(seq_id, length, end)
        if blocks is None:
            return False
        self._blocks.move_to(seq_id, blocks)
        del self.cache.setdefault(seq_id, [])[length:]
        self.gathers.append((seq_id, length))
        return True

    def blocks_of(self, seq_id: int) -> list[int]:
        """The blocks seq_id's cells take, for tests."""
        cells = self._blocks.held_cells(seq_id, len(self.cache.get(seq_id, [])))
        return [cell // self.prefix_share_block for cell in cells[::self.prefix_share_block]]

    def has_room(self, seq_id: int, end: int) -> bool:
        return self._blocks is None or end <= 0 or self._blocks.room(seq_id, end)

    def room_to_hold(self, seq_id: int, source_seq: int, length: int, end: int) -> bool:
        return self._blocks is None or end <= 0 or self._blocks.room_to_hold(seq_id, source_seq, length, end)

    def keepable(self, seq_id: int, length: int) -> int:
        return self._blocks.keepable(seq_id, length) if self._blocks is not None else length

    def cached_tokens(self, seq_id: int = 0) -> Optional[list[int]]:
        return list(self.cache.get(seq_id, []))
