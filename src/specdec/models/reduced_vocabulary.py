"""A draft model that scores only the most frequent tokens (FR-Spec, Zhao et al. 2025).

On a CPU a small draft model's step is mostly weight reads, and its output matrix is a large
share of them (the default 0.5B draft: 151,936 x 896 at Q8_0, 145 of the 392 MB a step reads).
Scoring only the tokens text is mostly made of makes every draft step cheaper; the draft can
then never propose the others, so a round where the target wants one of them accepts less.
Lossless either way: only what is proposed changes, never what is accepted.

llama.cpp ties the output matrix's shape to the vocabulary size, so the draft is derived once
into a GGUF of its own: the same weights, an output matrix of the chosen rows, no tokenizer and
`vocab_size` set to their number. Its input then comes as embeddings (rows of the original
token-embedding matrix, dequantized here), so any token may still be fed; its logits are spread
back over the full vocabulary with the other tokens at -inf. Which tokens: every control token,
then the shipped frequency ranking for the model's tokenizer (scripts/rank_frequent_tokens.py),
to `size` rows. A tokenizer without a shipped ranking keeps the full vocabulary.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from specdec.types import SpecdecError

RANKINGS_DIR = Path(__file__).resolve().parent.parent / "data" / "frequent_tokens"
ROW_MULTIPLE = 64  # repacked output matrices interleave rows in groups; keep every group whole
FORMAT = 1  # bump when the derived files change


def ranking_path(digest: str) -> Path:
    return RANKINGS_DIR / f"{digest[:16]}.npy"


def tokenizer_digest(model: "str | Path | object") -> str:
    """sha256 of a GGUF's token list: which ranking belongs to its tokenizer."""
    reader = _reader(model)
    field = reader.fields["tokenizer.ggml.tokens"]
    digest = hashlib.sha256()
    for index in field.data:
        digest.update(bytes(field.parts[index]))
        digest.update(b"\x00")
    return digest.hexdigest()


def _reader(model):
    import gguf

    return model if isinstance(model, gguf.GGUFReader) else gguf.GGUFReader(str(model))


def choose_tokens(ranking: np.ndarray, always: Sequence[int], vocab_size: int, size: int) -> np.ndarray:
    """Sorted ids of `size` tokens (a multiple of ROW_MULTIPLE): `always`, then by rank, then by id."""
    if size % ROW_MULTIPLE or size <= len(always):
        raise ValueError(f"a reduced vocabulary of {size} tokens: choose a multiple of {ROW_MULTIPLE} "
                         f"above the {len(always)} control tokens")
    chosen = dict.fromkeys(int(t) for t in always)
    for source in (ranking, range(vocab_size)):
        for token in source:
            if len(chosen) >= size:
                break
            if 0 <= int(token) < vocab_size:
                chosen.setdefault(int(token))
    return np.array(sorted(chosen), dtype=np.int64)


@dataclass
class ReducedVocabulary:
    """A derived draft (model_path) scoring token_ids, fed embeddings of the source's tokens."""

    model_path: Path
    token_ids: np.ndarray  # int64, sorted: logits row i of the derived model is token token_ids[i]
    embedding_rows: np.ndarray  # the source's token_embd, quantized bytes, one row per token
    embedding_type: int  # its GGML quantization type
    full_vocab_size: int

    @property
    def n_embd(self) -> int:
        import gguf

        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.embedding_type)]
        return self.embedding_rows.shape[1] // type_size * block

    def embeddings(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 [len(tokens), n_embd]: what the model's own embedding lookup would give."""
        import gguf

        rows = self.embedding_rows[np.asarray(tokens, dtype=np.int64)]
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(self.embedding_type))
        return np.ascontiguousarray(values.reshape(len(tokens), -1), dtype=np.float32)

    def full_logits(self, reduced: np.ndarray) -> np.ndarray:
        """Logits over the full vocabulary: the scored tokens' values, -inf for the others."""
        full = np.full(self.full_vocab_size, -np.inf, dtype=np.float32)
        full[self.token_ids] = reduced
        return full


def prepare(source: str | Path, cache_dir: Path, size: int) -> Optional[ReducedVocabulary]:
    """The reduced-vocabulary draft of `source` scoring `size` tokens (derived into cache_dir on
    first use, about 8 s for the default draft), or None when no shipped ranking fits its tokenizer."""
    source = Path(source).resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source} {stat.st_size} {stat.st_mtime_ns} {size} {FORMAT}".encode()).hexdigest()[:16]
    folder = cache_dir / f"{source.stem}.vocab{size}-{key}"
    if not (folder / "meta.json").exists():
        try:
            if not derive(source, folder, size):
                return None
        except (OSError, ValueError, KeyError) as error:
            raise SpecdecError(f"could not derive the reduced-vocabulary draft of {source.name} into {cache_dir} "
                               f"({error}); --draft-vocabulary 0 drafts with the full vocabulary.") from error
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("ranking") is None:
        return None
    return ReducedVocabulary(
        model_path=folder / "model.gguf",
        token_ids=np.load(folder / "token_ids.npy"),
        embedding_rows=np.load(folder / "token_embd.npy", mmap_mode="r"),
        embedding_type=meta["embedding_type"], full_vocab_size=meta["full_vocab_size"])


def derive(source: Path, folder: Path, size: int) -> bool:
    """Write the derived draft into `folder` (atomically); False when its tokenizer has no ranking
    (remembered in meta.json, so the source is not read again)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    ranking_file = ranking_path(tokenizer_digest(reader))
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if not ranking_file.exists():
        (partial / "meta.json").write_text(json.dumps({"ranking": None}))
        _publish(partial, folder)
        return False
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    vocab_size = len(types)
    control = [t for t, kind in enumerate(types) if kind != gguf.TokenType.NORMAL]
    token_ids = choose_tokens(np.load(ranking_file), control, vocab_size, size)

    writer = gguf.GGUFWriter(str(partial / "model.gguf"), arch)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_string("tokenizer.ggml.model", "no_vocab")  # so n_vocab comes from vocab_size
    writer.add_uint32(f"{arch}.vocab_size", len(token_ids))
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name in ("output.weight", "token_embd.weight"):
            # Tied embeddings (no output.weight): token_embd is the output matrix too.
            data = data.reshape(vocab_size, -1)[token_ids]
        if tensor.name == "token_embd.weight":
            embedding = tensor
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    np.save(partial / "token_ids.npy", token_ids)
    np.save(partial / "token_embd.npy", np.asarray(embedding.data).reshape(vocab_size, -1))
    (partial / "meta.json").write_text(json.dumps({
        "ranking": ranking_file.name, "size": len(token_ids), "full_vocab_size": vocab_size,
        "embedding_type": int(embedding.tensor_type), "source": str(source)}))
    _publish(partial, folder)
    return True


def _publish(partial: Path, folder: Path) -> None:
    try:
        os.replace(partial, folder)
    except OSError:  # another process published it first
        shutil.rmtree(partial, ignore_errors=True)
