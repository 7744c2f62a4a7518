"""Choosing the backend configuration per machine: the expected speculative rate on hand-computed
costs, the chooser (the fastest exact configuration, never an inexact one), `specdec calibrate
--configs ... --save` on fake backends with known forward costs, commands without --backend
resolving to the saved choice only on the machine it was measured on, and `auto` in a command
starting from the cost model saved for its exact setup instead of calibrating again."""
import json
import subprocess
import sys

import pytest

from fakes.clock import FakeClock
from dataclasses import replace

from specdec import runtime
from specdec.backends.cost_model import CostModel
from specdec.backends.fake import FakeBackend
from specdec.backends.registry import REGISTRY, BackendConfig
from specdec.cli import build_parser, main
from specdec.config_flags import config_from_args
from specdec.engine.engine import Engine
from specdec.machine_profile import (MAX_SAVED_COST_MODELS, best_speculative_rate, choose,
                                     cost_models_path, load_or_calibrate, parse_backend_configs, profile_entry,
                                     profile_path, save_cost_model, save_profile, saved_choice, saved_cost_model)
from specdec.types import SpecdecError


@pytest.fixture(autouse=True)
def specdec_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_best_speculative_rate_on_hand_computed_costs():
    cost = CostModel({1: 0.10, 2: 0.12, 3: 0.16, 4: 0.24}, draft_step_seconds=0.01)
    rate = best_speculative_rate(cost, acceptance=0.5, max_draft=3)
    # E(1) = 1.5, E(2) = 1.75, E(3) = 1.875 tokens; plain 1 / 0.1 = 10 tok/s.
    # n-gram: 1.5 / 0.12 = 12.5, 1.75 / 0.16 = 10.94, 1.875 / 0.24 = 7.81 -> one token.
    # draft: 1.5 / 0.13 = 11.54, 1.75 / 0.18 = 9.72, 1.875 / 0.27 = 6.94 -> one token.
    assert rate["plain_tokens_per_second"] == pytest.approx(10.0)
    assert rate["ngram"] == {"length": 1, "tokens_per_second": pytest.approx(12.5)}
    assert rate["draft"] == {"length": 1, "tokens_per_second": pytest.approx(1.5 / 0.13)}
    assert rate["best"] == {"drafter": "ngram", "length": 1, "tokens_per_second": pytest.approx(12.5)}
    assert rate["speedup"] == pytest.approx(1.25) and rate["end_to_end_tokens_per_second"] == pytest.approx(12.5)
    # Always accepted: E(j) = j + 1. n-gram 2 / 0.12, 3 / 0.16 = 18.75, 4 / 0.24; draft 3 / 0.18 = 16.67.
    bound = best_speculative_rate(cost, acceptance=1.0, max_draft=3)
    assert bound["best"] == {"drafter": "ngram", "length": 2, "tokens_per_second": pytest.approx(18.75)}
    assert bound["draft"] == {"length": 2, "tokens_per_second": pytest.approx(3 / 0.18)}


def test_best_speculative_rate_when_verification_is_linear_and_without_a_draft_model():
    cost = CostModel({n: 0.1 * n for n in range(1, 5)}, draft_step_seconds=None)
    rate = best_speculative_rate(cost, acceptance=0.6, max_draft=3)
    assert rate["draft"] is None
    assert rate["best"] == {"drafter": "ngram", "length": 1, "tokens_per_second": pytest.approx(1.6 / 0.2)}
    assert rate["end_to_end_tokens_per_second"] == pytest.approx(10.0)  # plain decoding wins
    with pytest.raises(ValueError):
        best_speculative_rate(cost, 0.6, max_draft=0)


def only_installed(monkeypatch, *names):
    """Pretend that only these backends' libraries are installed."""
    for name, entry in list(REGISTRY.items()):
        monkeypatch.setitem(REGISTRY, name, replace(entry, installed=lambda name=name: name in names))


def test_configuration_labels_parse_and_round_trip(monkeypatch):
    for label in ("ik_llama.cpp", "ik_llama.cpp:inexact", "ik_llama.cpp:repacked", "ik_llama.cpp:repacked:inexact",
                  "llama.cpp", "llama.cpp:inexact", "torch:bfloat16", "torch:float32:inexact"):
        assert BackendConfig.parse(label).label == label
    assert BackendConfig.parse("ik_llama.cpp:inexact:repacked") == BackendConfig("ik_llama.cpp", None, False, True)
    assert BackendConfig.parse("torch") == BackendConfig("torch", "bfloat16", True)
    assert BackendConfig.parse("torch:inexact") == BackendConfig("torch", "bfloat16", False)
    for bad in ("vllm", "torch:float16", "llama.cpp:float32", "ik_llama.cpp:bfloat16", "llama.cpp:repacked",
                "torch:repacked"):
        with pytest.raises(SpecdecError):
            BackendConfig.parse(bad)
    assert parse_backend_configs("llama.cpp, torch:float32,llama.cpp") == [BackendConfig("llama.cpp"),
                                                                   BackendConfig("torch", "float32")]
    only_installed(monkeypatch, "llama.cpp", "ik_llama.cpp")
    assert [c.label for c in parse_backend_configs("all")] == ["ik_llama.cpp", "ik_llama.cpp:inexact", "ik_llama.cpp:repacked",
                                                       "ik_llama.cpp:repacked:inexact", "llama.cpp", "llama.cpp:inexact"]
    assert [c.label for c in parse_backend_configs("exact")] == ["ik_llama.cpp", "ik_llama.cpp:repacked", "llama.cpp"]
    only_installed(monkeypatch)
    with pytest.raises(SpecdecError, match="no backend is installed"):
        parse_backend_configs("all")


def entry(label, step, per_token, draft_step=0.005, min_rows=1):
    """A configuration whose target forward over n tokens costs step + per_token * n; min_rows 2
    where its one-token steps are padded."""
    cost = CostModel({n: step + per_token * n for n in range(1, 17)}, draft_step)
    return profile_entry(BackendConfig.parse(label), cost, {"min_rows": min_rows})


def test_the_chooser_takes_the_fastest_exact_configuration_and_never_an_inexact_or_padded_one():
    linear = entry("llama.cpp", 0.005, 0.045)  # plain 20 tok/s, speculation slower
    flat_but_lossy = entry("llama.cpp:inexact", 0.045, 0.005)  # the fastest of all
    # plain 1 / 0.055 = 18.2 tok/s; at the measured acceptance (n-gram 0.46, draft model 0.78, its
    # step 5 ms) the best is the draft model at k = 2: (1 + 0.78 + 0.78^2) / (0.085 + 0.010) = 25.1 tok/s
    slower_step_cheap_verify = entry("torch:float32", 0.040, 0.015)
    assert linear["end_to_end_tokens_per_second"] == pytest.approx(20.0)
    assert slower_step_cheap_verify["end_to_end_tokens_per_second"] == pytest.approx((1 + 0.78 + 0.78 ** 2) / 0.095)
    assert slower_step_cheap_verify["expected"]["ngram"] == {"length": 1, "tokens_per_second": pytest.approx(1.46 / 0.07)}
    assert flat_but_lossy["end_to_end_tokens_per_second"] > slower_step_cheap_verify["end_to_end_tokens_per_second"]
    assert choose([linear, flat_but_lossy, slower_step_cheap_verify]) == "torch:float32"
    assert choose([linear, flat_but_lossy]) == "llama.cpp"
    assert choose([flat_but_lossy]) is None
    # t(2) barely above t(1), as when steps are padded (PyPI's ik build)
    padded = entry("ik_llama.cpp:repacked", 0.040, 0.001, min_rows=2)
    assert padded["end_to_end_tokens_per_second"] > slower_step_cheap_verify["end_to_end_tokens_per_second"]
    assert choose([linear, padded]) == "llama.cpp"  # its padded steps are overrated
    assert choose([linear, {**padded, "target": {"min_rows": 1}}]) == "ik_llama.cpp:repacked"  # specdec's build
    failed = {"config": "torch:bfloat16", "exact": True, "error": "torch is not installed"}
    assert choose([failed, linear]) == "llama.cpp"


# Per configuration: the target's (step, per-token) cost; the draft model's step costs 5 ms everywhere.
FAKE_COSTS = {"llama.cpp": (0.005, 0.045), "llama.cpp:inexact": (0.045, 0.005), "torch:float32": (0.040, 0.015)}


@pytest.fixture
def fake_engines(monkeypatch):
    """runtime.load_engine on fake backends whose forwards cost FAKE_COSTS on a fake clock;
    records the configurations loaded and how many engines were open at once. Append factors to
    `slowdowns` to make the next loads that much slower (a VM's drift)."""
    loaded, open_now, most_open, slowdowns = [], [0], [0], []

    def load_engine(models, n_slots=1, engine=None):
        label = models.backend.label
        if label not in FAKE_COSTS:
            raise SpecdecError(f"{label} is not installed here")
        clock = FakeClock()
        slowdown = slowdowns.pop(0) if slowdowns else 1.0
        step, per_token = (cost * slowdown for cost in FAKE_COSTS[label])
        engine = Engine(FakeBackend(seed=7, clock=clock, step_cost=step, token_cost=per_token),
                        FakeBackend(seed=7, noise=0.5, clock=clock, step_cost=0.004, token_cost=0.001), clock=clock)
        close = engine.close

        def closing():
            open_now[0] -= 1
            close()

        engine.close = closing
        loaded.append(label)
        open_now[0] += 1
        most_open[0] = max(most_open[0], open_now[0])
        return engine

    monkeypatch.setattr(runtime, "load_engine", load_engine)
    return loaded, most_open, slowdowns


def test_calibrate_measures_each_configuration_in_turn_prints_a_table_and_saves_the_choice(fake_engines, capsys):
    loaded, most_open, _ = fake_engines
    configs = "llama.cpp,llama.cpp:inexact,torch:float32,torch:bfloat16"
    assert main(["calibrate", "--configs", configs, "--save"]) == 0
    in_turn = ["llama.cpp", "llama.cpp:inexact", "torch:float32"]  # three rounds, the second in reverse
    assert loaded == in_turn + in_turn[::-1] + in_turn and most_open[0] == 1
    out = capsys.readouterr().out
    entries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [e["config"] for e in entries] == configs.split(",")
    llama = entries[0]
    assert llama["exact"] is True and llama["target_step_seconds"] == pytest.approx(0.050)
    assert llama["v"]["16"] == pytest.approx((0.005 + 0.045 * 16) / 0.050)
    assert llama["draft_cost_ratio"] == pytest.approx(0.005 / 0.050)
    assert entries[1]["exact"] is False and "torch is not installed" not in out
    assert entries[3]["error"] == "torch:bfloat16 is not installed here"

    table = out[out.index("| config"):].splitlines()
    rows = {line.split(" | ")[0].strip("| "): line for line in table if line.startswith("| ") and "config" not in line}
    assert rows["torch:float32"].rstrip().endswith("| yes |")
    assert "25.14 (draft k=2)" in rows["torch:float32"]
    assert "| 20.00 |" in rows["llama.cpp"] and not rows["llama.cpp:inexact"].rstrip().endswith("yes |")
    assert "failed: torch:bfloat16 is not installed here" in rows["torch:bfloat16"]
    assert table[-1].startswith("default: torch:float32")

    profile = json.loads(profile_path().read_text())
    assert profile["chosen"] == "torch:float32"
    assert set(profile["fingerprint"]) == {"cpu", "cores", "specdec"}
    assert [e["config"] for e in profile["configs"]] == configs.split(",")


def test_calibrate_keeps_the_median_of_its_rounds_so_a_slow_moment_does_not_decide(fake_engines, capsys):
    loaded, _, slowdowns = fake_engines
    slowdowns += [1.5]  # the first calibration runs while the machine is 1.5x slower
    assert main(["calibrate", "--configs", "llama.cpp,torch:float32"]) == 0
    assert loaded == ["llama.cpp", "torch:float32", "torch:float32", "llama.cpp", "llama.cpp", "torch:float32"]
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert entries[0]["target_step_seconds"] == pytest.approx(0.050)  # not 0.075
    slowdowns += [1.5]
    assert main(["calibrate", "--configs", "llama.cpp,torch:float32", "--rounds", "1"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert entries[0]["target_step_seconds"] == pytest.approx(0.075)
    assert main(["calibrate", "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_calibrate_without_configs_measures_the_named_one_and_fails_in_one_line_if_it_cannot(fake_engines, capsys,
                                                                                            monkeypatch):
    loaded, _, _ = fake_engines
    only_installed(monkeypatch, "llama.cpp", "torch")
    assert main(["calibrate", "--backend", "llama.cpp", "--inexact"]) == 0
    assert loaded == ["llama.cpp:inexact"]
    assert "default: llama.cpp (the first installed backend: no exact configuration was measured)" in \
        capsys.readouterr().out
    assert not profile_path().exists()  # no --save
    assert main(["calibrate", "--backend", "torch"]) == 2
    assert "torch:bfloat16 is not installed here" in capsys.readouterr().err


def test_calibrate_if_missing_measures_the_exact_configurations_once_per_machine(fake_engines, monkeypatch, capsys):
    loaded, _, _ = fake_engines
    only_installed(monkeypatch, "llama.cpp", "torch")
    command = ["calibrate", "--configs", "exact", "--save", "--if-missing"]
    assert main(command) == 0
    assert set(loaded) == {"llama.cpp", "torch:float32"}  # torch:bfloat16 is measured too, and fails to load
    assert saved_choice() == BackendConfig("torch", "float32")
    measured = len(loaded)
    assert main(command) == 0 and len(loaded) == measured
    assert "profile is current (default torch:float32)" in capsys.readouterr().err
    profile_path().unlink()
    only_installed(monkeypatch, "llama.cpp")
    assert main(command) == 0 and len(loaded) == measured and not profile_path().exists()
    assert "nothing to choose between" in capsys.readouterr().err


def loaded_backend(monkeypatch, argv):
    """The (backend, dtype, inexact) that `specdec generate ARGV` would load its models with."""
    seen = []

    def load_backend(models, path, n_slots=1, draft=False):
        seen.append((models.backend.backend, models.backend.dtype, not models.backend.exact))
        return FakeBackend(seed=7)

    monkeypatch.setattr(runtime, "load_backend", load_backend)
    args = build_parser().parse_args(["generate", "x", "--model", "t.gguf", "--draft-model", "d.gguf", *argv])
    runtime.load_engine(config_from_args(args).models).close()
    assert len(set(seen)) == 1
    return seen[0]


def test_a_command_without_backend_uses_the_choice_saved_on_this_machine(monkeypatch, capsys):
    only_installed(monkeypatch, "llama.cpp", "ik_llama.cpp", "torch")
    assert loaded_backend(monkeypatch, []) == ("ik_llama.cpp", None, False)  # no profile yet: the first installed
    only_installed(monkeypatch, "llama.cpp", "torch")
    assert loaded_backend(monkeypatch, ["--inexact"]) == ("llama.cpp", None, True)
    assert loaded_backend(monkeypatch, ["--backend", "torch"]) == ("torch", "bfloat16", False)
    assert loaded_backend(monkeypatch, ["--backend", "torch", "--dtype", "float32"]) == ("torch", "float32", False)
    assert loaded_backend(monkeypatch, ["--backend", "llama.cpp", "--dtype", "float32"]) == ("llama.cpp", None, False)
    entries = [entry(label, *FAKE_COSTS[label]) for label in ("llama.cpp", "torch:float32")]
    save_profile(entries, choose(entries))
    assert saved_choice() == BackendConfig("torch", "float32")
    assert loaded_backend(monkeypatch, []) == ("torch", "float32", False)
    assert loaded_backend(monkeypatch, ["--inexact"]) == ("torch", "float32", True)  # exactness stays the user's
    assert loaded_backend(monkeypatch, ["--backend", "llama.cpp"])[0] == "llama.cpp"  # explicit wins

    profile = json.loads(profile_path().read_text())
    profile["fingerprint"]["cpu"] = "another CPU"
    profile_path().write_text(json.dumps(profile))
    capsys.readouterr()
    assert loaded_backend(monkeypatch, []) == ("llama.cpp", None, False)
    assert "another machine" in capsys.readouterr().err
    profile_path().write_text("{not json")
    assert loaded_backend(monkeypatch, [])[0] == "llama.cpp"
    only_installed(monkeypatch)
    with pytest.raises(SpecdecError, match="no backend is installed"):
        loaded_backend(monkeypatch, [])


def test_resolving_the_default_backend_loads_no_library(specdec_home):
    code = ("import sys; from specdec.runtime import backend_config; "
            "assert backend_config().backend in ('ik_llama.cpp', 'llama.cpp', 'torch'); "
            "assert not {'torch', 'transformers', 'llama_cpp'} & set(sys.modules); "
            "assert 'specdec.backends.llama_family' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def calibrations(monkeypatch):
    """Counts Engine.calibrate calls (each is about 10 s on the real pair)."""
    count = [0]
    calibrate = Engine.calibrate

    def counting(self, slot=0):
        count[0] += 1
        return calibrate(self, slot)

    monkeypatch.setattr(Engine, "calibrate", counting)
    return count


def test_auto_in_generate_calibrates_once_then_starts_from_the_saved_cost_model(fake_engines, calibrations, capsys):
    generate = ["generate", "abc abc abc", "--backend", "llama.cpp", "--method", "auto", "--max-tokens", "6", "--json"]
    assert main(generate) == 0
    assert calibrations[0] == 1 and "calibrated this machine for auto" in capsys.readouterr().err
    saved = json.loads(cost_models_path().read_text())["setups"]
    (entry_,) = saved.values()
    assert float(entry_["cost_model"]["target_seconds"]["1"]) == pytest.approx(0.050)  # the fake's 5 + 45 ms
    assert main(generate) == 0
    captured = capsys.readouterr()
    assert calibrations[0] == 1 and "calibrated" not in captured.err
    assert json.loads(captured.out)["stats"]["method"] == "auto"
    assert main(["generate", "abc", "--backend", "llama.cpp", "--max-tokens", "2", "--method", "off"]) == 0
    assert calibrations[0] == 1  # only auto needs a cost model


def test_specdec_calibrate_refreshes_the_saved_cost_model(fake_engines, calibrations):
    assert main(["calibrate", "--backend", "llama.cpp"]) == 0
    assert calibrations[0] == 1 and cost_models_path().exists()
    assert main(["generate", "abc", "--backend", "llama.cpp", "--method", "auto", "--max-tokens", "2"]) == 0
    assert calibrations[0] == 1


def fake_engine(n_ctx=4096):
    clock = FakeClock()
    return Engine(FakeBackend(seed=7, clock=clock, step_cost=0.01, token_cost=0.02, n_ctx=n_ctx),
                  FakeBackend(seed=7, noise=0.5, clock=clock, step_cost=0.004, n_ctx=n_ctx), clock=clock)


def test_a_saved_cost_model_holds_only_for_its_own_setup(calibrations, tmp_path):
    path = tmp_path / "cost_models.json"
    engine = fake_engine()
    cost, measured = load_or_calibrate(engine, path)
    assert measured and calibrations[0] == 1 and engine.cost_model is cost
    again = fake_engine()
    reloaded, measured = load_or_calibrate(again, path)
    assert not measured and calibrations[0] == 1
    assert reloaded.target_seconds == cost.target_seconds and reloaded.draft_step_seconds == cost.draft_step_seconds
    assert again.cost_model is reloaded and "auto" in again.slots[0].drafters
    assert saved_cost_model(fake_engine(n_ctx=2048), path) is None  # another context: another setup
    assert saved_cost_model(Engine(FakeBackend(seed=7)), path) is None  # no draft model: another setup
    path.write_text("{not json")
    assert saved_cost_model(fake_engine(), path) is None
    assert load_or_calibrate(fake_engine(), path)[1] and calibrations[0] == 2  # unreadable: measured, rewritten
    assert saved_cost_model(fake_engine(), path) is not None


def test_the_saved_cost_models_are_bounded_oldest_first(tmp_path):
    path = tmp_path / "cost_models.json"
    cost = CostModel({1: 0.05, 2: 0.09})
    for n_ctx in range(64, 64 + MAX_SAVED_COST_MODELS + 2):
        save_cost_model(Engine(FakeBackend(seed=7, n_ctx=n_ctx)), cost, path)
    assert len(json.loads(path.read_text())["setups"]) == MAX_SAVED_COST_MODELS
    assert saved_cost_model(Engine(FakeBackend(seed=7, n_ctx=64)), path) is None
    assert saved_cost_model(Engine(FakeBackend(seed=7, n_ctx=64 + MAX_SAVED_COST_MODELS + 1)), path) is not None


def test_cost_model_json_round_trip_and_validation():
    cost = CostModel({1: 0.05, 2: 0.09, 16: 0.7}, draft_step_seconds=0.02, draft_prefill_seconds=0.001)
    back = CostModel.from_json(json.loads(json.dumps(cost.to_json())))
    assert (back.target_seconds, back.draft_step_seconds, back.draft_prefill_seconds) == \
        (cost.target_seconds, 0.02, 0.001)
    for bad in ({"target_seconds": {"2": 0.1}}, {"target_seconds": {"1": 0}}):
        with pytest.raises(ValueError):
            CostModel.from_json(bad)
