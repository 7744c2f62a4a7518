"""The context per slot (backends/context_size.py): the budget arithmetic as table cases, the GGUF
header read for it, the machine's memory, the configuration's `auto`, and runtime.load_engine
settling the size (and refusing one that does not fit) before any model loads."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from specdec import runtime
from specdec.backends import context_size as cs
from specdec.backends.context_size import GIB, KvShape, Memory, kv_budget, plan_context
from specdec.backends.fake import FakeBackend
from specdec.backends.registry import BackendConfig, ModelConfig
from specdec.config import load_config
from specdec.types import SpecdecError

# The default pair, as their GGUF headers give it: Qwen2.5-Coder-1.5B (28 layers, 2 KV heads of
# 128) and 0.5B (24 layers, 2 KV heads of 64), both trained for 32,768 positions; f16 K and V.
TARGET = KvShape(32768, 28 * 2 * (128 + 128) * 2)  # 28,672 bytes a token
DRAFT = KvShape(32768, 24 * 2 * (64 + 64) * 2)  # 12,288
PAIR = [TARGET, DRAFT]
WEIGHTS = 1_117_320_768 + 491_400_064
BIG = Memory(24 * GIB, 22 * GIB)  # a 24 GiB machine, mostly free


def test_the_pairs_bytes_per_token():
    assert (TARGET.bytes_per_token, DRAFT.bytes_per_token) == (28672, 12288)


@pytest.mark.parametrize("memory, weights, expected", [
    (Memory(24 * GIB, 22 * GIB), 2 * GIB, 8 * GIB),  # a third of the RAM
    (Memory(24 * GIB, 5 * GIB), 2 * GIB, 2 * GIB),  # what is available beside the weights and the margin
    (Memory(24 * GIB, 2 * GIB), 2 * GIB, 0),  # never negative
    (Memory(3 * GIB, 3 * GIB), 0, 1 * GIB),
])
def test_kv_budget(memory, weights, expected):
    assert kv_budget(memory, weights) == expected


# requested, slots, shapes, memory -> per slot, why
AUTO_CASES = [
    (None, 4, PAIR, BIG, 32768, "trained"),  # 4 x 32,768 x 40 KiB = 5 GiB, within 8 GiB
    (None, 1, PAIR, BIG, 32768, "trained"),
    (None, 8, PAIR, BIG, 24576, "budget"),  # 8 GiB / (8 x 40,960) = 26,214 -> 24,576 (whole 4,096s)
    (None, 4, PAIR, Memory(8 * GIB, 7 * GIB), 16384, "budget"),  # 8/3 GiB / (4 x 40,960) = 17,476 -> 16,384
    (None, 4, [TARGET], Memory(8 * GIB, 7 * GIB), 24576, "budget"),  # no draft: the target's bytes only (24,966)
    (None, 4, PAIR, Memory(4 * GIB, 3 * GIB), 4096, "floor"),  # the budget holds less than the floor
    (None, 4, [KvShape(2048, 28672)], Memory(4 * GIB, 3 * GIB), 2048, "trained"),  # never past the trained length
    (None, 4, [KvShape(32768, 28672), KvShape(16384, 12288)], BIG, 16384, "trained"),  # the shorter of the two
    (None, 4, [], BIG, 4096, "unknown"),  # no metadata: the former default
    (8192, 4, PAIR, BIG, 8192, "explicit"),
    (50000, 1, [KvShape(0, 28672)], BIG, 50000, "explicit"),  # trained length unknown: no check against it
]


@pytest.mark.parametrize("requested, slots, shapes, memory, per_slot, reason", AUTO_CASES)
def test_the_context_per_slot(requested, slots, shapes, memory, per_slot, reason):
    plan = plan_context(requested, slots=slots, shapes=shapes, weights=WEIGHTS, memory=memory)
    assert (plan.per_slot, plan.reason) == (per_slot, reason)
    assert plan.total == per_slot * slots
    assert (plan.warning is not None) == (reason == "floor")
    if reason in ("trained", "budget"):
        assert plan.kv_bytes <= plan.budget and plan.per_slot % 256 == 0


def test_an_explicit_size_past_the_trained_length_is_refused_in_one_line():
    with pytest.raises(SpecdecError, match=r"^--ctx-size 40,000 exceeds the 32,768 tokens the model was trained "
                                           r"for; give at most 32,768, or leave it out \(auto\)\.$"):
        plan_context(40000, slots=1, shapes=PAIR, weights=WEIGHTS, memory=BIG)


def test_an_explicit_size_that_the_memory_cannot_hold_is_refused_in_one_line():
    memory = Memory(8 * GIB, 4 * GIB)  # 4 GiB - 1.5 GiB weights - 1 GiB: 1.5 GiB for the KV
    with pytest.raises(SpecdecError, match=r"^--ctx-size 16,384 x 4 slots needs 2,560 MiB of KV cache but only "
                                           r"1,538 MiB of memory are available beside the weights; give at most 9,841, fewer --parallel slots") as raised:
        plan_context(16384, slots=4, shapes=PAIR, weights=WEIGHTS, memory=memory)
    assert "\n" not in str(raised.value)


def test_an_explicit_size_past_the_budget_but_within_the_memory_is_allowed_with_a_warning():
    memory = Memory(8 * GIB, 7 * GIB)  # budget 2.67 GiB, room 4.5 GiB
    plan = plan_context(24576, slots=4, shapes=PAIR, weights=WEIGHTS, memory=memory)  # 3.75 GiB
    assert plan.per_slot == 24576 and plan.warning and "more than the automatic budget of 2,731 MiB" in plan.warning


def test_the_start_up_line_states_the_trained_length_the_budget_and_the_context():
    line = plan_context(None, slots=4, shapes=PAIR, weights=WEIGHTS, memory=BIG).line()
    assert line.startswith("context: trained 32,768 tokens; KV budget 8,192 MiB (min of 0.33 x 24.0 GiB RAM, ")
    assert "32,768 tokens a slot (the trained length) x 4 slots = 131,072 tokens, 5,120 MiB of KV at 40.0 KiB a token" in line
    assert "\n" not in line


# -- the machine ------------------------------------------------------------------------------
MEMINFO = "MemTotal:       24683784 kB\nMemFree:        20000000 kB\nMemAvailable:   23766112 kB\nHugePages_Total:       0\n"


def test_meminfo_and_the_cgroups_limit(tmp_path):
    memory = cs.parse_meminfo(MEMINFO)
    assert memory == Memory(24683784 * 1024, 23766112 * 1024)
    assert cs.within_cgroup(memory, None, None) == memory
    assert cs.within_cgroup(memory, 8 * GIB, 3 * GIB) == Memory(8 * GIB, 5 * GIB)
    (tmp_path / "meminfo").write_text(MEMINFO)
    (tmp_path / "memory.max").write_text("max\n")
    assert cs.machine_memory(tmp_path / "meminfo", tmp_path) == memory
    (tmp_path / "memory.max").write_text(f"{4 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{1 * GIB}\n")
    assert cs.machine_memory(tmp_path / "meminfo", tmp_path) == Memory(4 * GIB, 3 * GIB)


# -- the models' metadata ---------------------------------------------------------------------
def write_gguf(path: Path, *, layers=28, heads=12, heads_kv=2, n_embd=1536, context=32768, extra=None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(context)
    writer.add_block_count(layers)
    writer.add_embedding_length(n_embd)
    writer.add_head_count(heads)
    writer.add_token_list([f"t{i}" for i in range(300)])  # a string array, skipped on the way
    if isinstance(heads_kv, list):
        writer.add_array("qwen2.attention.head_count_kv", heads_kv)
    else:
        writer.add_head_count_kv(heads_kv)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_the_kv_shape_from_a_gguf_header(tmp_path):
    assert cs.kv_shape(write_gguf(tmp_path / "t.gguf")) == TARGET
    assert cs.kv_shape(write_gguf(tmp_path / "d.gguf", layers=24, heads=14, n_embd=896)) == DRAFT
    # per-layer KV heads; key and value lengths where the file gives them
    assert cs.kv_shape(write_gguf(tmp_path / "a.gguf", layers=3, heads_kv=[1, 2, 4])).bytes_per_token == 7 * 256 * 2
    shape = cs.kv_shape(write_gguf(tmp_path / "k.gguf", extra={"qwen2.attention.key_length": 192,
                                                               "qwen2.attention.value_length": 128}))
    assert shape == KvShape(32768, 28 * 2 * (192 + 128) * 2)
    assert cs.kv_shape(tmp_path / "t.gguf", dtype_bytes=4).bytes_per_token == 2 * TARGET.bytes_per_token
    metadata = cs.gguf_metadata(tmp_path / "t.gguf")
    assert metadata["general.architecture"] == "qwen2" and "tokenizer.ggml.tokens" not in metadata


def test_an_unreadable_model_has_no_shape(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    assert cs.kv_shape(tmp_path / "junk.gguf") is None
    assert cs.kv_shape(tmp_path / "missing.gguf") is None
    write_gguf(tmp_path / "nolayers.gguf", layers=0)
    assert cs.kv_shape(tmp_path / "nolayers.gguf") == KvShape(32768, 0)


def test_the_kv_shape_from_a_hugging_face_config(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 28, "num_attention_heads": 12, '
                                          '"num_key_value_heads": 2, "hidden_size": 1536, '
                                          '"max_position_embeddings": 32768}')
    assert cs.kv_shape(tmp_path) == TARGET
    assert cs.kv_shape(tmp_path, dtype_bytes=4) == KvShape(32768, 2 * TARGET.bytes_per_token)


# -- the configuration ------------------------------------------------------------------------
from test_config import clean_environment  # noqa: E402, F401  (autouse: no SPECDEC_ setting from the machine)


NAMED = {"models.backend.backend": "llama.cpp"}


def test_the_default_is_auto_and_every_source_takes_auto_or_a_number(tmp_path):
    from specdec.config_flags import config_from_args
    from specdec.server.cli import parse_serve_flags

    assert ModelConfig(BackendConfig("llama.cpp")).ctx_size is None
    assert load_config(environ={}, flags=NAMED).models.ctx_size is None
    flags = ["--backend", "llama.cpp", "--model", "t.gguf"]
    assert config_from_args(parse_serve_flags([*flags, "--ctx-size", "auto"])).models.ctx_size is None
    assert config_from_args(parse_serve_flags([*flags, "--ctx-size", "8192"])).models.ctx_size == 8192
    path = tmp_path / "specdec.toml"
    path.write_text('[models]\nctx_size = "auto"\n')
    assert load_config(file=path, environ={}, flags=NAMED).models.ctx_size is None
    assert load_config(environ={"SPECDEC_MODELS_CTX_SIZE": "AUTO"}, flags=NAMED).models.ctx_size is None
    assert load_config(environ={}, flags={**NAMED, "models.ctx_size": 2048}, sets=["models.ctx_size=auto"]
                       ).models.ctx_size is None
    with pytest.raises(SpecdecError, match=r"^models.ctx_size takes an integer or auto, not 'big' \(--set\)\.$"):
        load_config(environ={}, flags=NAMED, sets=["models.ctx_size=big"])
    with pytest.raises(SystemExit):
        parse_serve_flags([*flags, "--ctx-size", "big"])


# -- runtime.load_engine settles it before any model loads --------------------------------------
@pytest.fixture
def pair(tmp_path, monkeypatch):
    """Two GGUF headers shaped like the default pair, and the backends they 'load': fakes that
    record the configuration they were given."""
    target = write_gguf(tmp_path / "target.gguf")
    draft = write_gguf(tmp_path / "draft.gguf", layers=24, heads=14, n_embd=896)
    loaded: list[ModelConfig] = []

    def load_backend(config, path, n_slots=1, draft=False):
        loaded.append(config)
        return FakeBackend(seed=1, n_ctx=config.n_ctx, max_sequences=n_slots)

    monkeypatch.setattr(runtime, "load_backend", load_backend)
    return target, draft, loaded


def test_load_engine_gives_each_model_the_planned_context_and_logs_it(pair, monkeypatch, caplog):
    target, draft, loaded = pair
    memory = Memory(8 * GIB, 7 * GIB)
    monkeypatch.setattr(runtime, "machine_memory", lambda: memory)
    config = ModelConfig(BackendConfig("llama.cpp"), target=str(target), draft=str(draft))
    expected = plan_context(None, slots=4, shapes=PAIR, weights=target.stat().st_size + draft.stat().st_size,
                            memory=memory)
    with caplog.at_level(logging.INFO, logger="specdec.context"):
        engine = runtime.load_engine(config, n_slots=4)
    try:
        assert expected.per_slot == 16384  # the budget's, not the trained length: this machine is small
        assert [each.ctx_size for each in loaded] == [16384, 16384]
        assert engine.model_config is not None and engine.model_config.ctx_size == 16384
        assert engine.target.n_ctx == 16384
        assert [each.getMessage() for each in caplog.records if each.name == "specdec.context"] == [expected.line()]
    finally:
        engine.close()


def test_load_engine_refuses_a_size_that_does_not_fit_before_loading_anything(pair, monkeypatch):
    target, draft, loaded = pair
    monkeypatch.setattr(runtime, "machine_memory", lambda: Memory(8 * GIB, 4 * GIB))
    for size, message in ((65536, "exceeds the 32,768 tokens"), (32768, "of KV cache but only")):
        config = ModelConfig(BackendConfig("llama.cpp"), target=str(target), draft=str(draft), ctx_size=size)
        with pytest.raises(SpecdecError, match=message):
            runtime.load_engine(config, n_slots=4)
    assert loaded == []


def test_load_engine_without_a_draft_counts_the_target_only(pair, monkeypatch):
    target, draft, loaded = pair
    monkeypatch.setattr(runtime, "machine_memory", lambda: Memory(8 * GIB, 7 * GIB))
    config = ModelConfig(BackendConfig("llama.cpp"), target=str(target), draft=str(draft), load_draft=False)
    runtime.load_engine(config, n_slots=4).close()
    assert [each.ctx_size for each in loaded] == [24576]  # 8/3 GiB / (4 x 28,672 bytes) = 24,966, whole 4,096s


def test_a_warning_reaches_the_log_as_one(pair, monkeypatch, caplog):
    target, draft, loaded = pair
    monkeypatch.setattr(runtime, "machine_memory", lambda: Memory(2 * GIB, 3 * GIB // 2))
    config = ModelConfig(BackendConfig("llama.cpp"), target=str(target), draft=str(draft))
    with caplog.at_level(logging.INFO, logger="specdec.context"):
        runtime.load_engine(config, n_slots=4).close()
    (record,) = [each for each in caplog.records if each.name == "specdec.context"]
    assert record.levelno == logging.WARNING and "taking the floor of 4,096" in record.getMessage()
    assert [each.ctx_size for each in loaded] == [4096, 4096]

