"""The real pair (Qwen2.5-Coder 1.5B target, 0.5B draft): greedy speculative output equals greedy
plain output token for token (and seeded sampled output, for n-gram proposals), and batched
verification logits equal one-token-step logits bit for bit, in the default (exact) mode."""
import json
import subprocess
import sys

import numpy as np
import pytest

from specdec.types import GenerationRequest, SamplingParams, SpecConfig

from spec_bench_prompts import spec_bench_prompts

# 20 prompts over all six Spec-Bench categories.
PER_CATEGORY = {"mt_bench": 4, "translation": 4, "summarization": 3, "qa": 3, "math_reasoning": 3, "rag": 3}
EQUALITY_PROMPTS = spec_bench_prompts(PER_CATEGORY)


@pytest.mark.parametrize("category,prompt", EQUALITY_PROMPTS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(EQUALITY_PROMPTS)])
def test_greedy_speculative_equals_plain(real_engine, category, prompt):
    prompt_ids = tuple(real_engine.encode_prompt(prompt, chat=True))
    outputs = {}
    for method, k in [("off", 0), ("ngram", 4), ("draft", 4), ("auto", 4)]:
        result = real_engine.generate(GenerationRequest(prompt_ids, 64, spec=SpecConfig(method, k)))
        outputs[method] = result.token_ids
        assert result.stats["generated_tokens"] == len(result.token_ids) <= 64
    assert outputs["ngram"] == outputs["off"]
    assert outputs["draft"] == outputs["off"]
    assert outputs["auto"] == outputs["off"]


def test_seeded_sampling_gives_the_same_text_with_and_without_n_gram_drafting(real_engine):
    """Sampled at temperature 0.7 with a seed, off, ngram and auto give one text per seed: n-gram
    proposals are verified against the target's own position-keyed samples (docs/exactness.md)."""
    drafted = accepted = 0
    for seed, category in enumerate(("summarization", "rag", "mt_bench")):
        prompt = next(p for c, p in EQUALITY_PROMPTS if c == category)
        prompt_ids = tuple(real_engine.encode_prompt(prompt, chat=True))
        sampling = SamplingParams(temperature=0.7, seed=seed)
        outputs, stats = {}, {}
        for method in ("off", "ngram", "auto"):
            result = real_engine.generate(GenerationRequest(prompt_ids, 48, sampling, SpecConfig(method, 3)))
            outputs[method], stats[method] = result.token_ids, result.stats
        drafted += stats["ngram"]["drafted_tokens"]
        accepted += stats["ngram"]["accepted_tokens"]
        assert outputs["ngram"] == outputs["off"], category
        # auto's draft-model rounds (none on a CPU where the draft model cannot pay) sample by the full rule
        if not any(choice.startswith(("draft", "hybrid")) for choice in stats["auto"]["choices"]):
            assert outputs["auto"] == outputs["off"], category
    assert accepted > 0 and drafted > accepted  # the n-gram path was exercised, rejections included


def _batched_vs_steps(engine, prefix_ids, continuation):
    """Logits of `continuation` evaluated in one batch, and one token at a time, after prefix_ids."""
    seq = engine.target_sequence
    seq.clear()
    seq.prefill(prefix_ids)
    batched = seq.extend(continuation)
    seq.truncate(len(prefix_ids))
    steps = np.concatenate([seq.extend([t]) for t in continuation])
    seq.clear()
    return batched, steps


@pytest.mark.parametrize("context", ["short", "long"])
def test_batched_logits_equal_one_step_logits_bit_for_bit(real_engine, context):
    """For every draft length 1..8 (verification evaluates 1 + k tokens), each position's batched
    logits equal its one-step logits exactly. `long` puts the KV cache past 512 cells, where
    llama.cpp's single-token attention would otherwise take a different (KV-split) path."""
    category = "mt_bench" if context == "short" else "summarization"
    prompt = next(p for c, p in EQUALITY_PROMPTS if c == category)
    prefix = real_engine.encode_prompt(prompt, chat=True)
    if context == "long":
        assert len(prefix) > 600
    continuation = real_engine.target.tokenize(" The quick brown fox jumps over the lazy dog again", add_special=False)
    for k in range(1, 9):
        tokens = continuation[: k + 1]
        batched, steps = _batched_vs_steps(real_engine, prefix, tokens)
        for position in range(len(tokens)):
            assert np.array_equal(batched[position], steps[position]), (
                f"k={k}: position {position} differs by up to {np.abs(batched[position] - steps[position]).max()}"
            )


def test_chat_template_comes_from_the_gguf(real_engine):
    text = real_engine.target.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert real_engine.target.eog_token_ids >= set(real_engine.target.tokenize("<|im_end|><|endoftext|>", add_special=False))


def test_cli_generate_json(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--json", "--chat", "--method", "ngram",
         "--max-tokens", "8", "Say hello."],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert set(payload) >= {"text", "token_ids", "stats"}
    assert len(payload["token_ids"]) == payload["stats"]["generated_tokens"] <= 8
    assert payload["stats"]["method"] == "ngram"


def test_prefix_reuse_gives_the_logits_of_processing_from_scratch(real_engine):
    """A prompt whose slot held another prompt sharing a prefix with it gets, bit for bit, the
    next-token logits of processing it from scratch: llama.cpp's results for a prompt position
    depend on the batch it was computed in, so prompts are processed in aligned chunks and only
    whole chunks are reused (engine/sequence.py)."""
    prompt = next(p for c, p in EQUALITY_PROMPTS if c == "summarization")
    ids = real_engine.encode_prompt(prompt, chat=True)
    detour = real_engine.target.tokenize(" Something else entirely, then more words.", add_special=False)
    seq = real_engine.target_sequence
    alignment = seq.alignment
    assert alignment > 1

    def next_token_logits(held=None):
        seq.clear()
        if held is not None:
            seq.prefill(held)
            seq.extend(detour[:3])  # and a few decode steps past it, as a finished request leaves
        reused = seq.prefill(ids[:-1])
        logits = seq.extend(ids[-1:])[-1].copy()
        seq.clear()
        return logits, reused

    scratch, _ = next_token_logits()
    for shared in (37, 130, 301):
        logits, reused = next_token_logits(ids[:shared] + detour)
        assert reused == shared // alignment * alignment
        assert np.array_equal(logits, scratch), f"shared prefix {shared}: up to {np.abs(logits - scratch).max()}"
    logits, reused = next_token_logits(ids[:-1])  # the very same prompt before: all of it reused
    assert reused == len(ids) - 1
    assert np.array_equal(logits, scratch)
