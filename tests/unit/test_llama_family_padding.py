"""LlamaFamilyBackend under kernel rules with min_rows (ik_llama.cpp's repacked weights): a call
shorter than min_rows is padded, the pad's logits never reach the caller and its KV cell is
removed right after the call. On a scripted binding, no library loaded."""
import ctypes
from types import SimpleNamespace

import pytest

from specdec.backends.bindings.base import KernelRules, LlamaBinding
from specdec.backends.llama_family import LlamaFamilyBackend
from specdec.types import SpecdecError

VOCAB = 8
CELLS = 64
RULES = KernelRules(max_decode_rows=4, prefill_alignment=1, flash_attn=False, context_per_sequence=True, min_rows=2)


class ScriptedBinding(LlamaBinding):
    """Logits of a row = its position in every entry; KV = the set of positions each context holds."""

    name = "scripted"
    repacks = True

    def __init__(self):
        self.calls: list[list[tuple[int, bool]]] = []  # per llama_decode: (position, logits wanted) per row
        self.cells: dict[int, set[int]] = {}
        self.loaded_repacked = None
        self._logits: list = []

    def rules(self, exact, repacked=False):
        return RULES if exact and repacked else KernelRules(max_decode_rows=None, prefill_alignment=1, flash_attn=False)

    def load_model(self, path, repack=False, vocab_only=False):
        self.loaded_repacked = repack
        return object()

    def free_model(self, model):
        pass

    def new_context(self, model, options):
        ctx = len(self.cells) + 1
        self.cells[ctx] = set()
        return ctx

    def free_context(self, ctx):
        pass

    def context_cells_per_sequence(self, ctx, n_seq_max):
        return CELLS

    def vocab(self, model):
        return None

    def n_vocab(self, vocab):
        return VOCAB

    def is_eog(self, vocab, token):
        return token == VOCAB - 1

    def tokenize(self, vocab, data, buffer, capacity, add_special):
        return 0

    def token_to_piece(self, vocab, token, buffer, length, special):
        return 0

    def meta_val_str(self, model, key, buffer, size):
        return -1

    def batch_init(self, capacity, n_seq_max, n_embd=0):
        return SimpleNamespace(token=[0] * capacity, pos=[0] * capacity, n_seq_id=[0] * capacity,
                               seq_id=[[0] for _ in range(capacity)], logits=[False] * capacity, n_tokens=0)

    def batch_free(self, batch):
        pass

    def decode(self, ctx, batch, rules):
        rows = [(batch.pos[i], bool(batch.logits[i])) for i in range(batch.n_tokens)]
        assert not {position for position, _ in rows} & self.cells[ctx], "a position was written twice"
        self.calls.append(rows)
        self.cells[ctx] |= {position for position, _ in rows}
        self._logits = [(ctypes.c_float * VOCAB)(*[float(position)] * VOCAB) for position, _ in rows]
        return 0

    def logits_ith(self, ctx, i):
        return ctypes.cast(self._logits[i], ctypes.POINTER(ctypes.c_float))

    def seq_rm(self, ctx, seq_id, start):
        self.cells[ctx] = {position for position in self.cells[ctx] if position < start}


@pytest.fixture
def backend(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(28))
    binding = ScriptedBinding()
    made = LlamaFamilyBackend(binding, path, n_ctx=CELLS, max_sequences=2, repack=True)
    yield made, binding
    made.close()


def test_a_one_token_step_is_padded_and_the_pad_leaves_neither_logits_nor_a_cell(backend):
    target, binding = backend
    assert binding.loaded_repacked and target.describe()["min_rows"] == 2
    target.eval(0, 0, [1, 2, 3], prefill=True)
    logits = target.eval(0, 3, [4])
    assert logits.shape == (1, VOCAB) and logits[0, 0] == 3.0  # position 3's row, not the pad's
    assert binding.calls[-1] == [(3, True), (4, True)]  # the pad wants logits too: one output kernel for all rows
    assert binding.cells[1] == {0, 1, 2, 3}
    rows = target.eval(0, 4, [5, 6])  # the next step writes the pad's position again: allowed, it is gone
    assert [row[0] for row in rows] == [4.0, 5.0] and binding.calls[-1] == [(4, True), (5, True)]


def test_a_one_row_prompt_chunk_is_padded_without_logits(backend):
    target, binding = backend
    target.eval(1, 0, [9], prefill=True)
    assert binding.calls == [[(0, False), (1, False)]]
    assert binding.cells[2] == {0}  # sequence 1 has a context of its own


def test_the_context_keeps_a_cell_for_the_pad(backend):
    target, _ = backend
    assert target.n_ctx == CELLS - 1
    with pytest.raises(SpecdecError, match="exceed the context"):
        target.eval(0, CELLS - 1, [1])


def test_a_library_without_a_repacked_layout_refuses_it(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(28))
    binding = ScriptedBinding()
    binding.repacks = False
    with pytest.raises(SpecdecError, match="no separate repacked weight layout"):
        LlamaFamilyBackend(binding, path, n_ctx=CELLS, repack=True)
