"""The reduced-vocabulary draft's derivation, on a small synthetic GGUF (the real draft: tests/integration)."""
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from specdec.models import reduced_vocabulary as rv  # noqa: E402

VOCAB, EMBD = 256, 64
CONTROL = (250, 251, 252)


def write_model(path, tied=False, tokens=None):
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_uint32("qwen2.embedding_length", EMBD)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens or [f"t{i}" for i in range(VOCAB)])
    writer.add_array("tokenizer.ggml.token_type", [3 if i in CONTROL else 1 for i in range(VOCAB)])
    writer.add_uint32("tokenizer.ggml.eos_token_id", CONTROL[0])
    matrices = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0}
    if not tied:
        matrices["output.weight"] = gguf.GGMLQuantizationType.Q8_0
    values = {}
    for name, qtype in matrices.items():
        values[name] = rng.standard_normal((VOCAB, EMBD)).astype(np.float32)
        data = gguf.quants.quantize(values[name], qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(EMBD, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


@pytest.fixture
def rankings(tmp_path, monkeypatch):
    folder = tmp_path / "rankings"
    folder.mkdir()
    monkeypatch.setattr(rv, "RANKINGS_DIR", folder)
    return folder


def rows_of(path, name):
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(-1, EMBD), reader


def test_tokens_are_the_control_ones_then_by_rank_then_by_id():
    chosen = rv.choose_tokens(np.array([7, 250, 3, 999, 7]), always=[250, 251], vocab_size=VOCAB, size=64)
    assert len(chosen) == 64 and list(chosen) == sorted(chosen)
    assert {250, 251, 7, 3} <= set(chosen)
    assert set(chosen) == {250, 251} | set(range(62))  # then filled by id; 999 is no token
    with pytest.raises(ValueError, match="multiple of 64"):
        rv.choose_tokens(np.array([1]), always=[], vocab_size=VOCAB, size=100)


@pytest.mark.parametrize("tied", [False, True])
def test_the_derived_model_keeps_the_chosen_output_rows_and_drops_the_tokenizer(tmp_path, rankings, tied):
    source = tmp_path / "draft.gguf"
    values = write_model(source, tied=tied)
    np.save(rv.ranking_path(rv.tokenizer_digest(source)), np.arange(VOCAB)[::-1].astype(np.int32))
    vocabulary = rv.prepare(source, tmp_path / "derived", size=64)
    assert vocabulary is not None
    ids = vocabulary.token_ids
    assert set(CONTROL) <= set(ids) and len(ids) == 64
    assert set(ids) == set(range(VOCAB - 64, VOCAB))  # the control tokens and the highest-ranked (highest ids)
    output_name = "token_embd.weight" if tied else "output.weight"
    source_rows, _ = rows_of(source, output_name)
    derived_rows, reader = rows_of(vocabulary.model_path, output_name)
    assert np.array_equal(derived_rows, source_rows[ids])  # the same quantized rows, chosen
    assert reader.fields["tokenizer.ggml.model"].contents() == "no_vocab"
    assert reader.fields["qwen2.vocab_size"].contents() == 64
    assert not any(key.startswith("tokenizer.ggml.tokens") for key in reader.fields)
    assert reader.fields["qwen2.embedding_length"].contents() == EMBD  # the rest is copied
    # Inputs are the source's own embeddings, dequantized as its lookup would.
    embedding_rows, _ = rows_of(source, "token_embd.weight")
    assert vocabulary.n_embd == EMBD
    assert np.array_equal(vocabulary.embeddings([5, 0, 5]), embedding_rows[[5, 0, 5]])
    np.testing.assert_allclose(vocabulary.embeddings([5]), values["token_embd.weight"][[5]], atol=0.05)
    # Logits come back over the full vocabulary, the unscored tokens at -inf.
    full = vocabulary.full_logits(np.arange(64, dtype=np.float32))
    assert full.shape == (VOCAB,) and np.array_equal(full[ids], np.arange(64))
    assert np.isneginf(np.delete(full, ids)).all()


def test_a_tokenizer_without_a_ranking_keeps_the_full_vocabulary_and_is_read_once(tmp_path, rankings, monkeypatch):
    source = tmp_path / "other.gguf"
    write_model(source, tokens=[f"u{i}" for i in range(VOCAB)])
    assert rv.prepare(source, tmp_path / "derived", size=64) is None
    (folder,) = (tmp_path / "derived").iterdir()
    assert json.loads((folder / "meta.json").read_text()) == {"ranking": None}
    monkeypatch.setattr(rv, "derive", lambda *args: pytest.fail("derived again"))
    assert rv.prepare(source, tmp_path / "derived", size=64) is None


def test_a_cache_that_cannot_be_written_is_one_clear_error(tmp_path, rankings):
    source = tmp_path / "draft.gguf"
    write_model(source)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    with pytest.raises(rv.SpecdecError, match="--draft-vocabulary 0 drafts with the full vocabulary"):
        rv.prepare(source, blocked, size=64)
