"""A tiny end-to-end benchmark on the weightless fake backend: records, report.md, report.json and
the charts; configuration labels; cache resets; failures recorded, not raised; and the target's
logit margin at the first token where a configuration's output left off's."""
import argparse
import json

import numpy as np
import pytest

from specdec.backends.fake import FakeBackend
from specdec.bench.cli import add_arguments, run_bench
from specdec.bench.runner import BenchConfig, first_difference, parse_bench_configs
from specdec.engine.engine import Engine
from specdec.types import DEFAULT_NUM_DRAFT_TOKENS, SpecdecError

PROMPTS = [
    {"id": "p1", "prompt": "the cat sat on the mat", "category": "chat"},
    {"id": "p2", "prompt": "abc abc abc abc", "category": "code"},
    {"id": "p3", "messages": [{"role": "user", "content": "hello world"}], "category": "chat"},
]


def fake_engine(_args=None):
    return Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6))


class Wrapped:
    """An engine that behaves like the real one, with hooks for tests."""

    def __init__(self, engine, on_generate=None, perturb=None):
        self.engine = engine
        self.on_generate = on_generate
        self.perturb = perturb
        self.calls = []
        self.resets = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def reset_cross_request_state(self):
        self.resets += 1

    def generate(self, request):
        self.calls.append(request.spec.method)
        if self.on_generate:
            self.on_generate(request, len(self.calls))
        result = self.engine.generate(request)
        if self.perturb and request.spec.method != "off":
            result.token_ids = self.perturb(list(result.token_ids))
        return result


def bench_args(tmp_path, *extra):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--dataset", str(data), "--out", str(tmp_path / "out"), "--max-tokens", "24",
                              "--no-progress", *extra])


def read_records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]


def test_parse_bench_configs_labels_and_always_runs_off_first():
    assert parse_bench_configs(["ngram"]) == [BenchConfig("off", "off", 0), BenchConfig("ngram", "ngram", DEFAULT_NUM_DRAFT_TOKENS)]
    labels = [c.label for c in parse_bench_configs(["ngram", "draft:k2", "off"], [2, 4])]
    assert labels == ["off", "ngram:k2", "ngram:k4", "draft:k2"]
    with pytest.raises(SpecdecError, match="unknown method"):
        parse_bench_configs(["eagle"])
    with pytest.raises(SpecdecError, match="ngram:k4"):
        parse_bench_configs(["ngram:4"])


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped earlier


def test_end_to_end_on_the_fake_backend(tmp_path):
    args = bench_args(tmp_path, "--methods", "off,ngram,draft", "--num-draft-tokens", "2,3", "--repeats", "2")
    engine = Wrapped(fake_engine())
    assert run_bench(args, engine_factory=lambda a: engine) == 0
    out = tmp_path / "out"
    records = read_records(tmp_path)
    labels = ["off", "ngram:k2", "ngram:k3", "draft:k2", "draft:k3"]
    assert len(records) == len(PROMPTS) * 2 * len(labels)
    # interleaved per prompt and repeat, off first
    assert [(r["prompt_id"], r["repeat"], r["config"]) for r in records[:6]] == \
        [("p1", 0, label) for label in labels] + [("p1", 1, "off")]
    assert all(r["success"] for r in records)
    assert all(r["matches_off"] is True for r in records if r["config"] != "off")  # lossless greedy
    first = records[1]
    for key in ("method", "prompt_tokens", "generated_tokens", "draft_rounds", "drafted_tokens", "accepted_tokens",
                "acceptance_rate", "mean_acceptance_length", "accepted_per_position", "draft_seconds",
                "verify_seconds", "prompt_seconds", "ttft_seconds", "total_seconds", "tokens_per_second"):
        assert key in first["stats"], key
    assert first["wall_seconds"] > 0 and first["output_token_ids"] and first["category"] == "chat"
    # a reset before every measured generation (plus the warm-up ones)
    assert engine.resets >= len(records)
    for name in ("report.md", "report.json", "speedup_by_category.png", "acceptance_length_histogram.png", "meta.json"):
        assert (out / name).exists(), name
    report = json.loads((out / "report.json").read_text())
    assert report["configs"] == labels
    assert list(report["summary"]) == ["chat", "code", "overall"]
    assert report["summary"]["overall"]["draft:k2"]["identical_to_off"] == 6
    assert report["summary"]["overall"]["draft:k2"]["speedup_mean"] > 0
    assert report["peers"]["llama-server"]["status"].startswith("not run")
    markdown = (out / "report.md").read_text()
    assert "## Overall" in markdown and "## chat" in markdown and "| draft:k3 |" in markdown
    assert "not run: not requested (--peer hf-assisted)" in markdown
    assert "Every successful output is identical to off" in markdown


def test_draft_model_is_loaded_only_when_a_draft_configuration_runs(tmp_path):
    seen = []
    args = bench_args(tmp_path, "--methods", "off,ngram", "--warmup", "0")
    run_bench(args, engine_factory=lambda models: seen.append(not models.load_draft) or Engine(FakeBackend(seed=7)))
    assert seen == [True]
    args = bench_args(tmp_path, "--methods", "draft", "--no-draft", "--out", str(tmp_path / "other"))
    with pytest.raises(SpecdecError, match="--no-draft"):
        run_bench(args, engine_factory=fake_engine)


def test_auto_is_calibrated_before_the_first_timed_generation(tmp_path):
    calibrated_at_generate = []
    engine = fake_engine()

    def note(request, n):
        calibrated_at_generate.append(engine.cost_model is not None)

    args = bench_args(tmp_path, "--methods", "off,auto", "--warmup", "0")
    assert run_bench(args, engine_factory=lambda a: Wrapped(engine, on_generate=note)) == 0
    assert calibrated_at_generate == [True] * 6  # off and auto on 3 prompts, none paying for calibration


def test_failures_become_records_and_the_run_goes_on(tmp_path):
    def fail_ngram(request, n):
        if request.spec.method == "ngram":
            raise RuntimeError("drafter exploded")

    args = bench_args(tmp_path, "--methods", "off,ngram,draft", "--warmup", "0")
    assert run_bench(args, engine_factory=lambda a: Wrapped(fake_engine(), on_generate=fail_ngram)) == 0
    records = read_records(tmp_path)
    failed = [r for r in records if not r["success"]]
    assert [r["config"] for r in failed] == ["ngram"] * 3
    assert failed[0]["error"] == "RuntimeError: drafter exploded"
    assert all(r["success"] for r in records if r["config"] != "ngram")
    assert "drafter exploded" in (tmp_path / "out" / "report.md").read_text()


def test_a_difference_records_its_position_and_the_target_logit_margin(tmp_path):
    def perturb(tokens):
        tokens[3] = (tokens[3] + 1) % 100
        return tokens

    args = bench_args(tmp_path, "--methods", "off,ngram", "--warmup", "0")
    engine = Engine(FakeBackend(seed=7))
    assert run_bench(args, engine_factory=lambda a: Wrapped(engine, perturb=perturb)) == 0
    records = read_records(tmp_path)
    off, ngram = records[0], records[1]
    assert ngram["matches_off"] is False
    assert ngram["first_diff_position"] == 3
    assert ngram["off_token"] == off["output_token_ids"][3]
    # the margin is the target's top-1 minus top-2 logit after prompt + off[:3]
    prompt_ids = engine.encode_prompt([{"role": "user", "content": PROMPTS[0]["prompt"]}], chat=True)
    logits = np.sort(FakeBackend(seed=7)._row(prompt_ids + off["output_token_ids"][:3]).astype(np.float64))
    assert ngram["target_logit_margin"] == pytest.approx(logits[-1] - logits[-2], rel=1e-6)
    assert ngram["target_argmax_at_diff"] == off["output_token_ids"][3]
    # the re-evaluation left the engine's caches consistent: later prompts still match when unperturbed
    assert all(r["success"] for r in records)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(report["differences"]) == 3
    assert report["summary"]["overall"]["ngram"]["identical_to_off"] == 0


def test_an_existing_run_is_not_overwritten_without_resume(tmp_path):
    args = bench_args(tmp_path, "--methods", "off", "--warmup", "0")
    run_bench(args, engine_factory=fake_engine)
    before = (tmp_path / "out" / "records.jsonl").read_text()
    with pytest.raises(SpecdecError, match="--resume"):
        run_bench(args, engine_factory=fake_engine)
    assert (tmp_path / "out" / "records.jsonl").read_text() == before


def test_odd_repeats_run_off_last_and_are_still_compared_with_it(tmp_path):
    def perturb(tokens):
        tokens[3] = (tokens[3] + 1) % 100
        return tokens

    args = bench_args(tmp_path, "--methods", "off,ngram,draft", "--warmup", "0", "--repeats", "2")
    engine = Wrapped(fake_engine(), perturb=perturb)
    assert run_bench(args, engine_factory=lambda a: engine) == 0
    assert engine.calls[:6] == ["off", "ngram", "draft", "draft", "ngram", "off"]
    records = read_records(tmp_path)
    assert len(records) == len(PROMPTS) * 2 * 3
    orders = {(r["prompt_id"], r["repeat"], r["config"]): r["order"] for r in records}
    assert [orders[("p1", 0, c)] for c in ("off", "ngram", "draft")] == [0, 1, 2]
    assert [orders[("p1", 1, c)] for c in ("off", "ngram", "draft")] == [2, 1, 0]
    # measured before off, compared once off was recorded: the perturbation is found in both repeats
    for record in records:
        if record["config"] != "off":
            assert record["matches_off"] is False and record["first_diff_position"] == 3, record["repeat"]


def test_resume_after_a_kill_before_off_measures_the_waiting_configurations_again(tmp_path):
    class Killed(BaseException):  # like KeyboardInterrupt: not a failed generation, the process dies
        pass

    def die_at_the_fourth_generation(request, n):
        if n == 4:
            raise Killed()

    args = bench_args(tmp_path, "--methods", "off,ngram", "--warmup", "0", "--repeats", "2")
    with pytest.raises(Killed):
        run_bench(args, engine_factory=lambda a: Wrapped(fake_engine(), on_generate=die_at_the_fourth_generation))
    # p1: off, ngram (repeat 0), then ngram, off (repeat 1): ngram of repeat 1 waited for off and was lost
    assert [(r["repeat"], r["config"]) for r in read_records(tmp_path)] == [(0, "off"), (0, "ngram")]
    resumed = Wrapped(fake_engine())
    run_bench(bench_args(tmp_path, "--methods", "off,ngram", "--warmup", "0", "--repeats", "2", "--resume"),
              engine_factory=lambda a: resumed)
    assert resumed.calls[:2] == ["ngram", "off"]
    records = read_records(tmp_path)
    assert len(records) == len(PROMPTS) * 2 * 2
    assert all(r["matches_off"] is True for r in records if r["config"] == "ngram")


def test_a_compared_backend_runs_interleaved_with_its_own_off_and_is_reported_beside_the_peers(tmp_path):
    """--compare-backend: a second engine (here a fake with other weights, standing for another
    backend) runs every configuration too, interleaved per prompt; its configurations are compared
    with its own off, and the report gives its speedup over its own off and over the first engine's."""
    loaded = []

    def factory(models):
        loaded.append(models.backend.backend)
        seed = 7 if len(loaded) == 1 else 11
        return Engine(FakeBackend(seed=seed), FakeBackend(seed=seed, noise=0.6))

    args = bench_args(tmp_path, "--methods", "ngram,draft", "--repeats", "2", "--warmup", "0",
                      "--backend", "llama.cpp", "--compare-backend", "ik_llama.cpp")
    run_bench(args, engine_factory=factory)
    assert loaded == ["llama.cpp", "ik_llama.cpp"]
    records = read_records(tmp_path)
    other = "specdec@ik_llama.cpp"
    assert {r["source"] for r in records} == {"specdec", other}
    assert len(records) == 3 * 2 * 6
    for prompt in ("p1", "p2", "p3"):
        for repeat in (0, 1):
            run = sorted((r for r in records if r["prompt_id"] == prompt and r["repeat"] == repeat),
                         key=lambda r: r["order"])
            labels = [r["config"] for r in run]
            mine = ["off", "ngram", "draft", f"{other}:off", f"{other}:ngram", f"{other}:draft"]
            assert labels == (mine if repeat == 0 else mine[::-1])  # interleaved, order alternating
    theirs = [r for r in records if r["source"] == other and r["config"] != f"{other}:off"]
    assert theirs and all(r["matches_off"] is True for r in theirs)  # against its own off: exact
    own_off = {(r["prompt_id"], r["repeat"]): r["output_token_ids"] for r in records if r["config"] == "off"}
    other_off = {(r["prompt_id"], r["repeat"]): r["output_token_ids"] for r in records if r["config"] == f"{other}:off"}
    assert own_off != other_off  # other weights: comparing with the first engine's off would have failed
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["configs"] == ["off", "ngram", "draft"]
    row = report["peers"][other]["configs"][f"{other}:draft"]
    assert row["speedup_mean"] > 0 and row["speedup_vs_specdec_off"] > 0
    assert row["identical_text_to_own_off"] == row["compared_with_own_off"] == 6
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["compare_backends"] == ["ik_llama.cpp"]
    with pytest.raises(SpecdecError, match="already the backend"):
        run_bench(bench_args(tmp_path, "--backend", "llama.cpp", "--compare-backend", "llama.cpp",
                             "--out", str(tmp_path / "again")), engine_factory=factory)


def test_compare_methods_limits_what_runs_on_the_compared_backend(tmp_path):
    """--compare-methods off: the other backend runs plain decoding only, still interleaved per
    prompt, and is reported beside the first engine's configurations."""
    def factory(models):
        return Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6))

    args = bench_args(tmp_path, "--methods", "ngram,draft", "--warmup", "0", "--backend", "llama.cpp",
                      "--compare-backend", "ik_llama.cpp", "--compare-methods", "off")
    run_bench(args, engine_factory=factory)
    records = read_records(tmp_path)
    other = "specdec@ik_llama.cpp"
    assert sorted({r["config"] for r in records}) == sorted(["off", "ngram", "draft", f"{other}:off"])
    assert len(records) == 3 * 4
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["peers"][other]["configs"][f"{other}:off"]["speedup_vs_specdec_off"] > 0
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["compare_methods"] == "off"


class ForwardingResets(Wrapped):
    def reset_cross_request_state(self):
        super().reset_cross_request_state()
        self.engine.reset_cross_request_state()


@pytest.mark.parametrize("tenant_history", [False, True])
def test_tenant_history_holds_the_runs_earlier_prompts_and_their_off_outputs(tmp_path, tenant_history):
    held = []  # (prompt tokens, method, tokens in the anonymous tenant's history) at each generation

    def note(request, n):
        history = engine.engine.cross_request.for_tenant(None)
        held.append((len(request.prompt_token_ids), request.spec.method, len(history)))

    engine = ForwardingResets(fake_engine(), on_generate=note)
    flags = ["--tenant-history"] if tenant_history else []
    args = bench_args(tmp_path, "--methods", "off,auto", "--warmup", "0", "--repeats", "2", *flags)
    assert run_bench(args, engine_factory=lambda a: engine) == 0
    records = read_records(tmp_path)
    assert all(r["matches_off"] for r in records if r["config"] == "auto")
    offs = {(r["prompt_id"], r["repeat"]): r for r in records if r["config"] == "off"}
    expected = []
    for r in records:
        earlier = [p["id"] for p in PROMPTS][:[p["id"] for p in PROMPTS].index(r["prompt_id"])]
        tokens = sum(offs[(e, r["repeat"])]["prompt_tokens"] + len(offs[(e, r["repeat"])]["output_token_ids"])
                     for e in earlier)
        expected.append((r["prompt_tokens"], r["method"], tokens if tenant_history else 0))
    assert sorted(held) == sorted(expected) and len({h[0] for h in held}) == len(PROMPTS)
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["tenant_history"] is tenant_history
