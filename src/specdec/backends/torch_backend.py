"""PyTorch backend: a Hugging Face causal LM run by transformers on the CPU.

Loads a model folder (config.json + safetensors) or a GGUF file (transformers dequantizes it),
in bfloat16 by default or float32, with one DynamicCache per sequence; rollback crops it.
torch and transformers are imported only when this backend is built, so the llama.cpp path and
`specdec --help` never load them.

Exact mode (the default) makes evaluating k tokens at once give, at every position, bit for bit
the logits of k one-token steps: no batch of more than one row is bit-exact at real sizes (one row
runs a matrix-vector kernel, more rows a matrix-matrix kernel with another accumulation order;
docs/exactness.md, "PyTorch"), so decode-time tokens go one row per forward and exact speculation
here shows equality but saves no target time. `exact=False` batches them (faster, lossy). Prompts
go in large chunks aligned to multiples of 64, so prefix caching reuses only positions computed as
a fresh prompt computes them.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from specdec.backends.base import Backend, aligned_chunks, check_gguf_file, default_threads
from specdec.types import SpecdecError

DTYPES = ("bfloat16", "float32")
DEFAULT_DTYPE = "bfloat16"
EXACT_MAX_DECODE_ROWS = 1  # see the module docstring: no larger batch is bit-exact at real sizes
EXACT_PREFILL_ALIGNMENT = 64  # as on llama.cpp: a prompt position's numbers depend on its batch


def import_torch():
    """torch and transformers, or a SpecdecError that says how to install them."""
    try:
        import torch
        import transformers
    except ImportError:
        raise SpecdecError("the torch backend needs torch and transformers: pip install 'specdec[torch]'.") from None
    return torch, transformers


def load_model_and_tokenizer(model_path: str | Path, dtype: str = DEFAULT_DTYPE):
    """A model folder or a .gguf file -> (model in eval mode, tokenizer), from local files only."""
    if dtype not in DTYPES:
        raise SpecdecError(f"unknown dtype {dtype!r}; choose {' or '.join(DTYPES)}.")
    torch, transformers = import_torch()
    path = Path(model_path)
    if path.is_dir():
        folder, gguf = path, {}
    elif path.suffix.lower() == ".gguf":
        check_gguf_file(path)
        folder, gguf = path.parent, {"gguf_file": path.name}
    elif not path.exists():
        raise SpecdecError(f"model {path} does not exist.")
    else:
        raise SpecdecError(f"{path} is neither a model folder (config.json + weights) nor a .gguf file.")
    transformers.utils.logging.disable_progress_bar()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, **gguf)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, dtype), local_files_only=True, **gguf)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecdecError(f"transformers could not load {path}: {exc}") from None
    return model.eval(), tokenizer


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The generation config's end-of-sequence ids (one or a list) and the tokenizer's."""
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return frozenset(int(i) for i in ids)


def token_pieces(tokenizer, vocab_size: int) -> tuple[list[bytes], list[bytes]]:
    """Per token id: (its bytes as text, its bytes in the vocabulary fingerprint).

    Byte-level BPE spells each byte as one printable character; the inverse table gives the raw
    bytes back, so a UTF-8 character split across tokens is reassembled exactly. Special added
    tokens (e.g. <|im_start|>) render as nothing, like llama.cpp's control tokens, but keep their
    text in the fingerprint; other added tokens are plain text. Ids past the tokenizer (a logits
    width padded beyond it) have no bytes.
    """
    import json

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    if "ByteLevel" not in json.dumps(decoder):
        raise SpecdecError("the torch backend reads byte-level BPE tokenizers (Qwen, Llama 3, GPT-2 style) only.")
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    added = tokenizer.added_tokens_decoder
    names = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
    text, fingerprint = [], []
    for token_id in range(vocab_size):
        name = names[token_id] if token_id < len(names) else None
        if token_id in added:
            content = added[token_id].content.encode("utf-8")
            text.append(b"" if added[token_id].special else content)
            fingerprint.append(content)
            continue
        piece = b"" if name is None else b"".join(
            bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in name)
        text.append(piece)
        fingerprint.append(piece)
    return text, fingerprint


class TorchBackend(Backend):
    name = "torch"

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = DEFAULT_DTYPE,
        n_ctx: int = 4096,
        n_threads: Optional[int] = None,
        max_sequences: int = 4,
        exact: bool = True,
    ):
        self._torch, transformers = import_torch()
        self._dynamic_cache = transformers.DynamicCache
        self.model_path = Path(model_path)
        self.dtype = dtype
        self.exact = exact
        self.n_ctx = n_ctx
        self.max_sequences = max_sequences
        self.n_threads = n_threads or default_threads()
        self._torch.set_num_threads(self.n_threads)
        self.model, self.tokenizer = load_model_and_tokenizer(self.model_path, dtype)
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)  # the logits' width
        self.eog_token_ids = eos_token_ids(self.model, self.tokenizer)
        self._pieces, self._fingerprint_pieces = token_pieces(self.tokenizer, self.vocab_size)
        self._decode_rows = EXACT_MAX_DECODE_ROWS if exact else None  # None: the whole evaluation at once
        # Exact prefix caching: prompts in aligned chunks, whole chunks reused (backends/sequence.py).
        self.prefill_alignment = EXACT_PREFILL_ALIGNMENT if exact else 1
        self._caches: dict[int, object] = {}  # seq_id -> DynamicCache, made on first use
        self._lock = threading.Lock()  # one forward or crop at a time

    # -- tokenizer ----------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special, split_special_tokens=not parse_special))

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    def fingerprint_bytes(self, token_id: int) -> bytes:
        return self._fingerprint_pieces[token_id]

    def chat_template_source(self) -> Optional[str]:
        template = self.tokenizer.chat_template
        return template if isinstance(template, str) and template else None

    def apply_chat_template(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> str:
        if not self.tokenizer.chat_template:
            raise SpecdecError(f"{self.model_path.name} has no chat template; use a raw completion prompt instead.")
        from jinja2.exceptions import TemplateError

        try:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                      tools=list(tools) if tools else None)
        except TemplateError as exc:
            raise SpecdecError(f"the chat template refused the messages: {exc}") from None

    # -- evaluation ----------------------------------------------------------------------------
    def eval(self, seq_id: int, start: int, tokens: Sequence[int], *, prefill: bool = False) -> np.ndarray:
        torch = self._torch
        empty = np.zeros((0, self.vocab_size), dtype=np.float32)
        if not 0 <= seq_id < self.max_sequences:
            raise SpecdecError(f"sequence {seq_id} is out of range: this backend holds {self.max_sequences}.")
        with self._lock, torch.inference_mode():
            cache = self._caches.get(seq_id)
            cached = cache.get_seq_length() if cache is not None else 0
            if start != cached:
                raise SpecdecError(f"evaluation at position {start}, but sequence {seq_id} caches {cached} tokens.")
            if start + len(tokens) > self.n_ctx:
                raise SpecdecError(f"the sequence would exceed the context of {self.n_ctx} tokens.")
            if len(tokens) == 0:
                return empty
            if cache is None:
                cache = self._caches[seq_id] = self._dynamic_cache(config=self.model.config)
            ids = torch.tensor([list(tokens)], dtype=torch.long)
            if prefill:  # only each chunk's last row of logits is computed, none returned
                for offset, length in aligned_chunks(start, len(tokens), self.prefill_alignment):
                    self.model(input_ids=ids[:, offset:offset + length], past_key_values=cache, use_cache=True,
                               logits_to_keep=1)
                return empty
            rows = self._decode_rows or len(tokens)
            logits = [self.model(input_ids=ids[:, i:i + rows], past_key_values=cache, use_cache=True).logits[0]
                      for i in range(0, len(tokens), rows)]
            return torch.cat(logits).float().numpy()

    def truncate(self, seq_id: int, length: int) -> None:
        with self._lock:
            cache = self._caches.get(seq_id)
            if cache is None:
                return
            if length <= 0:
                del self._caches[seq_id]
                return
            excess = cache.get_seq_length() - length
            if excess > 0:
                cache.crop(-excess)  # a negative count removes that many positions (transformers 4 and 5)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "model": str(self.model_path),
            "dtype": self.dtype,
            "threads": self.n_threads,
            "exact": self.exact,
            "max_decode_rows": self._decode_rows,
            "attention": self.model.config._attn_implementation if self.model is not None else None,
        }

    def close(self) -> None:
        """Free the caches and the weights (the bench closes its engine before a peer loads its own)."""
        self._caches.clear()
        self.model = None
