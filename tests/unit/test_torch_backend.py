"""The torch backend on tiny random Qwen2 models built here (no download): exact mode makes
batched logits equal one-token steps bit for bit, rollback reproduces them, token bytes are raw
(UTF-8 split across tokens reassembles), and speculative greedy output equals plain greedy.
The hf-assisted peer runs transformers' own generate on the same models through `specdec bench`."""
import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdec.backends.torch_backend import TorchBackend  # noqa: E402
from specdec.engine.engine import Engine  # noqa: E402
from specdec.types import GenerationRequest, SpecConfig, SpecdecError  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the cat sat on the mat, the dog sat on the log", "héllo wörld, naïve café",
          "def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"]
PROMPTS = ["the cat sat on the mat", "def add(a, b):", "héllo wörld"]


def build_tokenizer():
    """A byte-level BPE trained on a few sentences, with Qwen's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def save_model(folder, tokenizer, seed, base=None, noise=0.0):
    """A 2-layer Qwen2 with wide random weights (distinct logits, no argmax ties); with `base`,
    base's weights plus noise: a draft that agrees with its target often, not always."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    if base is not None:
        with torch.no_grad():
            for param, base_param in zip(model.parameters(), base.parameters()):
                param.copy_(base_param + noise * base_param.std() * torch.randn_like(base_param))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    target = save_model(root / "target", tokenizer, seed=0)
    save_model(root / "draft", tokenizer, seed=1, base=target, noise=0.05)  # accepts about half
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def target(model_dirs):
    return TorchBackend(model_dirs[0], dtype="float32", n_threads=1)


@pytest.fixture(scope="module")
def draft(model_dirs):
    return TorchBackend(model_dirs[1], dtype="float32", n_threads=1)


def batched_and_stepwise(backend, prefix, tokens, seq_id=0):
    """Logits of `tokens` after `prefix`: evaluated at once, then one token per call."""
    backend.truncate(seq_id, 0)
    backend.eval(seq_id, 0, prefix, prefill=True)
    batched = backend.eval(seq_id, len(prefix), tokens)
    backend.truncate(seq_id, len(prefix))
    steps = np.concatenate([backend.eval(seq_id, len(prefix) + i, [t]) for i, t in enumerate(tokens)])
    backend.truncate(seq_id, 0)
    return batched, steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_mode_batched_logits_equal_one_token_steps_bit_for_bit(model_dirs, dtype):
    backend = TorchBackend(model_dirs[0], dtype=dtype, n_threads=1)
    prefix = backend.tokenize(backend.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]), add_special=False)
    tokens = backend.tokenize(" the cat sat on the mat", add_special=False)
    batched, steps = batched_and_stepwise(backend, prefix, tokens)
    assert batched.dtype == np.float32 and batched.shape == (len(tokens), backend.vocab_size)
    assert np.array_equal(batched, steps)
    assert backend.describe()["dtype"] == dtype and backend.describe()["max_decode_rows"] == 1


def test_inexact_mode_batches_the_same_computation(model_dirs):
    """One forward for all rows: not bit-exact in float32 (see the module docstring), but close."""
    backend = TorchBackend(model_dirs[0], dtype="float32", n_threads=1, exact=False)
    batched, steps = batched_and_stepwise(backend, backend.tokenize("the cat"), backend.tokenize(" sat on the mat"))
    np.testing.assert_allclose(batched, steps, rtol=0, atol=1e-4)
    assert backend.describe()["max_decode_rows"] is None


def test_truncate_then_eval_again_reproduces_the_logits(target):
    tokens = target.tokenize("the dog sat on the log, the cat sat on the mat")
    first = target.eval(1, 0, tokens)
    target.truncate(1, 5)
    assert np.array_equal(target.eval(1, 5, tokens[5:]), first[5:])
    target.truncate(1, 0)
    assert np.array_equal(target.eval(1, 0, tokens), first)
    target.truncate(1, 0)


def test_eval_checks_the_cached_length_and_the_sequence(target):
    target.truncate(2, 0)
    target.eval(2, 0, target.tokenize("the cat"), prefill=True)
    with pytest.raises(SpecdecError, match="caches"):
        target.eval(2, 0, [5])
    with pytest.raises(SpecdecError, match="out of range"):
        target.eval(target.max_sequences, 0, [5])
    assert target.eval(2, len(target.tokenize("the cat")), [], prefill=True).shape == (0, target.vocab_size)
    target.truncate(2, 0)


def test_tokens_are_raw_bytes_and_special_text_is_parsed(target):
    text = "héllo wörld € 10"  # '€' is not in the corpus: three byte tokens
    ids = target.tokenize(text)
    pieces = [target.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode("utf-8") and target.detokenize(ids) == text
    assert any(_not_utf8(piece) for piece in pieces)  # a character split across tokens
    special = target.tokenize("<|im_start|>user\nhi<|im_end|>")
    im_start, im_end = target.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert special[0] == im_start and special[-1] == im_end
    assert target.token_bytes(im_start) == b"" and target.fingerprint_bytes(im_start) == b"<|im_start|>"
    assert target.eog_token_ids == frozenset({im_end})
    assert target.vocab_size == target.model.config.vocab_size


def _not_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_chat_template_renders_with_the_assistant_prompt(target):
    rendered = target.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("method,k", [("ngram", 3), ("draft", 2), ("draft", 4)])
def test_speculative_greedy_equals_plain_greedy(target, draft, method, k):
    engine = Engine(target, draft)
    drafted = accepted = 0
    for prompt in PROMPTS:
        prompt_ids = tuple(engine.encode_prompt(prompt, chat=True))
        plain = engine.generate(GenerationRequest(prompt_ids, 24, spec=SpecConfig("off")))
        spec = engine.generate(GenerationRequest(prompt_ids, 24, spec=SpecConfig(method, k)))
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.finish_reason == plain.finish_reason
        drafted += spec.stats["drafted_tokens"]
        accepted += spec.stats["accepted_tokens"]
    assert drafted > 0 and (accepted > 0 or method == "ngram")  # random text seldom repeats
    engine.clear_cache()


def write_gguf(path, model, tokenizer):
    """The tiny model as a float32 GGUF, named and described as llama.cpp's converter does for Qwen2."""
    import gguf

    config = model.config
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    special = {added.content for added in tokenizer.added_tokens_decoder.values() if added.special}
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":  # tied to the embedding: llama.cpp writes no output.weight then
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_loads_as_the_same_model(model_dirs, target, tmp_path):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32)
    write_gguf(tmp_path / "tiny.gguf", model, target.tokenizer)
    backend = TorchBackend(tmp_path / "tiny.gguf", dtype="float32", n_threads=1)
    text = "<|im_start|>user\nhéllo wörld €<|im_end|>"
    assert backend.tokenize(text) == target.tokenize(text)
    assert backend.vocab_fingerprint() == target.vocab_fingerprint()
    assert backend.eog_token_ids == target.eog_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert backend.apply_chat_template(messages) == target.apply_chat_template(messages)
    tokens = target.tokenize("the cat sat on the mat")
    target.truncate(3, 0)
    assert np.array_equal(backend.eval(0, 0, tokens), target.eval(3, 0, tokens))
    target.truncate(3, 0)


def test_loading_errors_are_one_line(tmp_path):
    with pytest.raises(SpecdecError, match="does not exist"):
        TorchBackend(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(SpecdecError, match="neither a model folder"):
        TorchBackend(tmp_path / "weights.bin")
    with pytest.raises(SpecdecError, match="dtype"):
        TorchBackend(tmp_path, dtype="float16")


def test_help_and_the_llama_cpp_path_do_not_import_torch():
    code = ("import sys; from specdec.cli import build_parser; import specdec.runtime, specdec.bench.cli; "
            "build_parser().parse_args(['generate', 'x', '--backend', 'torch']); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_with_the_hf_assisted_peer(model_dirs, tmp_path):
    """`specdec bench --backend torch --peer hf-assisted`: our methods and transformers' plain,
    assisted and prompt-lookup generate on the same prompts, in records of the peers' shape."""
    import argparse

    from specdec.bench.cli import add_arguments, run_bench

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:2])))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--dataset", str(data), "--out", str(tmp_path / "out"), "--max-tokens", "12",
                              "--methods", "off,ngram:k3,draft:k2", "--warmup", "0", "--no-progress",
                              "--backend", "torch", "--dtype", "float32", "--threads", "1",
                              "--model", str(model_dirs[0]), "--draft-model", str(model_dirs[1]),
                              "--peer", "hf-assisted"])
    assert run_bench(args) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    peer = [r for r in records if r["source"] == "hf-assisted"]
    assert [r["config"] for r in peer] == ["hf-assisted:off"] * 2 + ["hf-assisted:draft:k2"] * 2 + ["hf-assisted:ngram:k3"] * 2
    for record in peer:
        assert record["success"], record["error"]
        assert record["output_token_ids"] and record["finish_reason"] in ("stop", "length")
        assert record["stats"]["generated_tokens"] == len(record["output_token_ids"]) <= 12
        assert record["stats"]["prompt_seconds"] > 0 and record["wall_seconds"] > 0
        assert record["prompt_tokens"] == next(r["prompt_tokens"] for r in records
                                               if r["source"] == "specdec" and r["prompt_id"] == record["prompt_id"])
    by_key = {(r["config"], r["prompt_id"]): r for r in peer}
    for prompt_id in ("0", "1"):
        plain = by_key[("hf-assisted:off", prompt_id)]
        assert by_key[("hf-assisted:ngram:k3", prompt_id)]["output_token_ids"] == plain["output_token_ids"]
        assert plain["matches_specdec_off"] is True  # transformers' greedy decode == ours
    own = [r for r in records if r["source"] == "specdec"]
    assert all(r["success"] and r.get("matches_off") in (None, True) for r in own)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["peers"]["hf-assisted"]["status"] == "run"
    assert report["meta"]["backend"] == "torch" and report["meta"]["engine"]["target"]["dtype"] == "float32"
