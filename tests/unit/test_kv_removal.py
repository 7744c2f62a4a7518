"""A KV-cache removal the library refuses (llama_memory_seq_rm / llama_kv_cache_seq_rm answering
false, as for a partial removal on a recurrent model's cache) is an error, never a cache that
silently keeps positions the decoder rolled back. On the scripted binding of the padding tests."""
import pytest
from test_llama_family_padding import CELLS, ScriptedBinding

from specdec.backends.llama_family import LlamaFamilyBackend
from specdec.types import SpecdecError


class RefusingBinding(ScriptedBinding):
    """Removes nothing and answers False, as llama.cpp does where a removal cannot be partial."""

    def __init__(self):
        super().__init__()
        self.removals: list[tuple[int, int]] = []

    def seq_rm(self, ctx, seq_id, start):
        self.removals.append((seq_id, start))
        return False


class ReportingBinding(ScriptedBinding):
    def seq_rm(self, ctx, seq_id, start):
        super().seq_rm(ctx, seq_id, start)
        return True


def backend_on(binding, tmp_path, repack=False):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(28))
    return LlamaFamilyBackend(binding, path, n_ctx=CELLS, max_sequences=2, repack=repack)


def test_a_refused_rollback_raises_instead_of_keeping_a_stale_cache(tmp_path):
    binding = RefusingBinding()
    backend = backend_on(binding, tmp_path)
    try:
        backend.eval(0, 0, [1, 2, 3, 4], prefill=True)
        with pytest.raises(SpecdecError, match="refused to remove a sequence's KV cache from position 2 on"):
            backend.truncate(0, 2)
        assert binding.removals == [(0, 2)]
    finally:
        backend.close()


def test_a_refused_removal_of_a_pads_cell_raises_too(tmp_path):
    binding = RefusingBinding()
    backend = backend_on(binding, tmp_path, repack=True)  # min_rows 2: a one-token step is padded
    try:
        backend.eval(0, 0, [1, 2, 3], prefill=True)
        with pytest.raises(SpecdecError, match="refused to remove"):
            backend.eval(0, 3, [4])
    finally:
        backend.close()


def test_an_accepted_removal_goes_on(tmp_path):
    binding = ReportingBinding()
    backend = backend_on(binding, tmp_path)
    try:
        backend.eval(0, 0, [1, 2, 3, 4], prefill=True)
        backend.truncate(0, 2)
        assert binding.cells[1] == {0, 1}
        backend.eval(0, 2, [5, 6], prefill=True)  # positions 2 and 3 again: they are gone
    finally:
        backend.close()
