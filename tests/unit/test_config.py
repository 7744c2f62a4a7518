"""The one configuration (specdec/config.py) and its flags (specdec/config_flags.py): the order of
its sources, every field reachable, values converted by type with one-line errors, the keys kept
out of files and --set, and the engine and `auto` actually built with what was configured."""
from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
from dataclasses import fields, is_dataclass, replace
from pathlib import Path

import pytest

from specdec import runtime
from specdec.backends.cost_model import CostModel
from specdec.backends.fake import FakeBackend
from specdec.cli import main
from specdec.config import SECRETS, SECTIONS, SETTINGS, SpecdecConfig, convert, load_config
from specdec.config_flags import config_from_args
from specdec.engine.engine import Engine, EngineConfig
from specdec.server.cli import parse_serve_flags
from specdec.types import SpecdecError

SRC = Path(__file__).resolve().parents[2] / "src"
BASE = ["--backend", "llama.cpp", "--model", "t.gguf"]  # named: no machine profile or installed library consulted


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    """No SPECDEC_ setting or key from the machine running the tests; a profile-less home."""
    for name in list(os.environ):
        if name.startswith("SPECDEC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))


def serve(*argv: str, ray: bool = True, keys: bool = False) -> SpecdecConfig:
    """The configuration `specdec serve --ray BASE ARGV` deploys."""
    return config_from_args(parse_serve_flags([*(["--ray"] if ray else []), *BASE, *argv]), keys=keys, ray=ray)


def value_of(config: SpecdecConfig, key: str):
    section, _, name = key.rpartition(".")
    holder = config
    for attribute in SECTIONS.get(section, ()):
        holder = getattr(holder, attribute)
    return getattr(holder, name)


def toml_line(key: str, value) -> str:
    section, _, name = key.rpartition(".")
    return (f"[{section}]\n" if section else "") + f"{name} = {json.dumps(value)}\n"


# -- precedence ---------------------------------------------------------------------------------------
# key, its flag (None: none), then its value in the defaults, a TOML file, the environment, the flag, --set
PRECEDENCE = [
    ("models.ctx_size", "--ctx-size", None, 512, 1024, 2048, 256),  # None: auto (backends/context_size.py)
    ("engine.ngram_max", None, 3, 4, 5, None, 6),
    ("policy.margin", None, 0.02, 0.1, 0.2, None, 0.3),
    ("server.max_queue", "--max-queue", 64, 1, 2, 3, 5),
    ("server.spec.num_draft_tokens", "--num-draft-tokens", 3, 4, 5, 6, 7),
    ("scale.replicas", "--replicas", 1, 2, 3, 4, 5),
    ("slots", "--parallel", 4, 1, 2, 3, 5),
]


@pytest.mark.parametrize("key, flag, default, in_file, in_env, in_flag, in_set", PRECEDENCE)
def test_each_source_overrides_the_one_before(key, flag, default, in_file, in_env, in_flag, in_set, tmp_path,
                                              monkeypatch):
    env = "SPECDEC_" + key.replace(".", "_").upper()
    path = tmp_path / "specdec.toml"
    path.write_text(toml_line(key, in_file))
    assert value_of(serve(), key) == default
    assert value_of(serve("--config", str(path)), key) == in_file
    monkeypatch.setenv(env, str(in_env))
    assert value_of(serve("--config", str(path)), key) == in_env
    flags = [flag, str(in_flag)] if flag else []
    if flag:
        assert value_of(serve("--config", str(path), *flags), key) == in_flag
    assert value_of(serve("--config", str(path), *flags, "--set", f"{key}={in_set}"), key) == in_set


def test_a_flag_given_at_its_default_still_overrides_the_file(tmp_path):
    path = tmp_path / "specdec.toml"
    path.write_text("slots = 2\n[server]\nmax_queue = 9\n")
    config = serve("--config", str(path), "--parallel", "4", "--max-queue", "64")
    assert (config.slots, config.server.max_queue) == (4, 64)
    assert (serve("--config", str(path)).slots, serve("--config", str(path)).server.max_queue) == (2, 9)


def test_a_serve_configs_args_sit_between_the_file_and_the_environment(tmp_path):
    path = tmp_path / "specdec.toml"
    path.write_text("[engine]\nngram_max = 4\nngram_min = 2\n")
    backend = {"models.backend.backend": "llama.cpp"}
    config = load_config(file=path, mapping={"engine": {"ngram_max": 5}}, environ={}, flags=backend)
    assert (config.engine.ngram_max, config.engine.ngram_min) == (5, 2)
    config = load_config(file=path, mapping={"engine": {"ngram_max": 5}}, environ={"SPECDEC_ENGINE_NGRAM_MAX": "6"},
                         flags=backend)
    assert config.engine.ngram_max == 6


def test_no_new_option_changes_nothing():
    config = serve(ray=False)
    assert config.engine == EngineConfig() and config.scale == type(config.scale)()
    assert config.slots == 4 and config.server.max_queue == 64 and config.models.ctx_size is None
    assert config.server.served_model_name == "t" and config.server.allowed_hosts == ("localhost", "127.0.0.1", "::1")


# -- every field --------------------------------------------------------------------------------------
# Values that pass validation only with another setting beside them, or are not free-form.
SAMPLES = {
    "models.backend.backend": ("torch", []),
    "models.backend.dtype": ("float32", ["models.backend.backend=torch"]),
    "models.backend.repacked": ("true", ["models.backend.backend=ik_llama.cpp"]),
    "models.draft_vocabulary": ("0", []),
    "models.ctx_size": ("8192", []),  # left at None (auto): a size at least 16
    "server.log_level": ("debug", []),
    "server.spec.method": ("ngram", []),
    "server.allowed_hosts": ("api.example.com", []),
    "policy.draft_scale_range": ("0.25,4", []),
    "scale.prefix_routing_chars": ("0", []),
    "scale.min_replicas": ("1", ["scale.max_replicas=3"]),
    "scale.max_replicas": ("3", ["scale.min_replicas=1"]),
    "scale.upscale_delay": ("5", ["scale.min_replicas=1", "scale.max_replicas=3"]),
    "scale.downscale_delay": ("5", ["scale.min_replicas=1", "scale.max_replicas=3"]),
}


def sample(key: str, default) -> str:
    """A valid value other than the default, as --set takes it."""
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, (int, float)):
        return str(default + 1)
    if isinstance(default, str):
        return default + "-other"
    return "7"  # an Optional[int], Optional[float] or Optional[str] left at None


def test_every_field_of_every_section_is_reachable_by_set():
    default = serve()
    for key in SETTINGS:
        if key in SECRETS:
            continue
        text, companions = SAMPLES.get(key, (None, []))
        text = text or sample(key, value_of(default, key))
        sets = [part for setting in (*companions, f"{key}={text}") for part in ("--set", setting)]
        assert value_of(serve(*sets), key) != value_of(default, key), key
    # ... and the keys cover every field of every section: each a key, or a section itself
    for section, path in {"": (), **SECTIONS}.items():
        holder = default
        for attribute in path:
            holder = getattr(holder, attribute)
        for each in fields(holder):
            key = f"{section}.{each.name}".lstrip(".")
            assert key in SETTINGS or is_dataclass(getattr(holder, each.name)), key


def test_the_keys_are_never_read_from_a_file_the_generic_variables_or_set(tmp_path, monkeypatch):
    for key in sorted(SECRETS):
        with pytest.raises(SpecdecError, match=f"^{key} cannot be set in --set: API keys go in a keys file"):
            serve("--set", f"{key}=sk-secret")
    path = tmp_path / "specdec.toml"
    path.write_text('[server]\napi_key = "sk-secret"\n')
    with pytest.raises(SpecdecError, match="cannot be set in the configuration file") as raised:
        serve("--config", str(path))
    assert "sk-secret" not in str(raised.value)
    monkeypatch.setenv("SPECDEC_SERVER_API_KEY", "sk-secret")
    with pytest.raises(SpecdecError, match=r"^\$SPECDEC_SERVER_API_KEY is not read"):
        serve()
    monkeypatch.delenv("SPECDEC_SERVER_API_KEY")
    # Today's ways still work: the flag, and the key variables; never in a repr.
    config = serve("--api-key", "sk-flag", keys=True)
    assert config.server.api_key == "sk-flag" and "sk-flag" not in repr(config)
    monkeypatch.setenv("SPECDEC_API_KEY", "sk-env")
    assert serve(keys=True).server.api_key == "sk-env"
    assert serve().server.api_key is None  # a command that serves nothing reads no keys


# -- conversion and errors ----------------------------------------------------------------------------
def test_values_are_converted_by_their_fields_type(monkeypatch):
    config = serve("--set", "models.threads=none", "--set", "server.limit_concurrency=None",
                   "--set", "engine.prefix_cache=off", "--set", "policy.margin=1", "--set", "slots=2",
                   "--set", "server.max_prompt_bytes=1000", "--set", "policy.draft_scale_range=0.5, 2")
    assert config.models.threads is None and config.server.limit_concurrency is None
    assert config.engine.prefix_cache is False and config.policy.margin == 1.0 and isinstance(config.policy.margin, float)
    assert config.slots == 2 and config.server.max_prompt_bytes == 1000 and config.policy.draft_scale_range == (0.5, 2.0)
    assert convert("server.allowed_hosts", "a.example, b.example", SETTINGS["server.allowed_hosts"]) == (
        "a.example", "b.example")
    monkeypatch.setenv("SPECDEC_MODELS_BACKEND_BY_RULE", "true")  # models.backend_by_rule, not models.backend.by_rule
    monkeypatch.setenv("SPECDEC_SERVER_SPEC_METHOD", "ngram")
    config = serve()
    assert config.models.backend_by_rule and config.server.spec.method == "ngram"


@pytest.mark.parametrize("setting, message", [
    ("engine.ngram_max=x", r"^engine.ngram_max takes an integer, not 'x' \(--set\)\.$"),
    ("engine.prefix_cache=maybe", r"^engine.prefix_cache takes true or false, not 'maybe'"),
    ("policy.margin=cheap", r"^policy.margin takes a number, not 'cheap'"),
    ("models.threads=many", r"^models.threads takes an integer or none, not 'many'"),
    ("policy.draft_scale_range=1", r"^policy.draft_scale_range takes 2 comma-separated values \(a number, a number\)"),
    ("nosuch.field=1", r"^unknown section 'nosuch' in 'nosuch.field' \(--set\); sections: models, models.backend"),
    ("engine.ngram_mx=1", r"^unknown setting 'engine.ngram_mx' \(--set\); did you mean 'engine.ngram_max'\?$"),
    ("engine.ngram_max", r"^--set takes KEY=VALUE \(e.g. engine.ngram_max=4\), not 'engine.ngram_max'\.$"),
    ("policy.margin=-1", r"^invalid policy configuration"),
    ("engine.ngram_min=4", r"^engine.ngram_min and engine.ngram_max need 1 <= ngram_min <= ngram_max\.$"),
    ("models.ctx_size=8", r"^--ctx-size must be at least 16\.$"),
    ("server.log_level=loud", r"^--log-level must be one of debug, info, warning, error\.$"),
    ("server.spec.method=fast", r"^unknown speculative method 'fast'"),
    ("models.backend.backend=tpu", r"^unknown backend 'tpu'"),
])
def test_a_bad_setting_is_a_one_line_error_naming_it(setting, message):
    with pytest.raises(SpecdecError, match=message) as raised:
        serve("--set", setting)
    assert "\n" not in str(raised.value)
    assert main(["serve", *BASE, "--set", setting]) == 2  # the CLI prints it, no traceback


def test_bad_files_and_variables_are_one_line_errors(tmp_path, monkeypatch):
    path = tmp_path / "specdec.toml"
    for text, message in (('[engine]\nngram_max = "four"\n', "engine.ngram_max takes an integer, not 'four' "
                                                              r"\(the configuration file"),
                          ("[engine]\nprefix_cache = 1\n", "engine.prefix_cache takes true or false, not 1"),
                          ("[engin]\nngram_max = 4\n", "unknown section 'engin'"),
                          ("[engine\n", "is not TOML")):
        path.write_text(text)
        with pytest.raises(SpecdecError, match=message):
            serve("--config", str(path))
    with pytest.raises(SpecdecError, match="cannot read the configuration file"):
        serve("--config", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("SPECDEC_ENGINE_BOGUS", "1")
    with pytest.raises(SpecdecError, match=r"^unknown setting 'engine.bogus' \(\$SPECDEC_ENGINE_BOGUS\)"):
        serve()


def test_ray_settings_without_ray_are_refused_from_any_source(tmp_path):
    path = tmp_path / "specdec.toml"
    path.write_text("[scale]\nreplicas = 2\n")
    with pytest.raises(SpecdecError, match=r"^--replicas is a Ray Serve setting: add --ray\.$"):
        serve("--config", str(path), ray=False)
    assert serve("--config", str(path)).scale.replicas == 2


# -- the settings reach the engine --------------------------------------------------------------------
TUNED = ["--set", "engine.ngram_max=5", "--set", "engine.ngram_min=2", "--set", "engine.prefix_cache=false",
         "--set", "engine.cross_request_ngrams=false", "--set", "policy.margin=0.3", "--set", "policy.max_match=8",
         "--set", "policy.draft_scale_range=0.25,4"]


def test_engine_and_policy_settings_reach_the_engine_and_auto(monkeypatch):
    monkeypatch.setattr(runtime, "load_backend", lambda models, path, n_slots=1, draft=False: FakeBackend(seed=7))
    config = serve("--draft-model", "d.gguf", *TUNED)
    engine = runtime.load_engine(config.models, n_slots=2, engine=config.engine)
    try:
        assert engine.config == config.engine and engine.config.policy.margin == 0.3
        for slot in engine.slots:
            ngram = slot.drafters["ngram"]
            assert (ngram.max_ngram, ngram.min_ngram) == (5, 2)
        engine.use_cost_model(CostModel({1: 0.05, 2: 0.06, 4: 0.08}, 0.01))
        for slot in engine.slots:
            auto = slot.drafters["auto"]
            assert auto.config == config.policy and auto.margin == 0.3
    finally:
        engine.close()
    assert runtime.load_engine(config.models).config == EngineConfig()  # no engine settings: the defaults


@pytest.fixture
def engines_built(monkeypatch):
    """The engine settings each engine a command loads is given (on the fake backend)."""
    seen = []

    def load_engine(models, n_slots=1, engine=None):
        seen.append(engine)
        return Engine(FakeBackend(seed=7), config=engine)

    monkeypatch.setattr(runtime, "load_engine", load_engine)
    return seen


def test_specdec_generate_builds_its_engine_with_them(engines_built, capsys):
    seen = engines_built
    assert main(["generate", "hello", *BASE, "--method", "ngram", "--max-tokens", "4", "--json", *TUNED]) == 0
    assert seen[0].ngram_max == 5 and seen[0].policy.margin == 0.3
    assert json.loads(capsys.readouterr().out)["stats"]["method"] == "ngram"


def test_specdec_bench_builds_its_engine_with_them(engines_built, tmp_path):
    seen = engines_built
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "p1", "prompt": "hello hello hello"}) + "\n")
    assert main(["bench", *BASE, "--dataset", str(data), "--methods", "off,ngram", "--max-tokens", "4",
                 "--out", str(tmp_path / "out"), "--no-progress", *TUNED]) == 0
    assert seen and seen[0].ngram_max == 5 and seen[0].policy.margin == 0.3


# -- Ray: the configuration itself travels --------------------------------------------------------------
def test_the_configuration_pickles_whole():
    config = serve(*TUNED, "--api-key", "sk-flag", keys=True)
    assert pickle.loads(pickle.dumps(config)) == config


def test_scale_config_needs_no_ray():
    code = ("import sys; from specdec.deploy.scale import ScaleConfig; from specdec.config import load_config; "
            "import specdec.server.cli, specdec.config_flags; ScaleConfig(replicas=2).validate(); "
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(SRC)})


def test_the_replicas_receive_the_configuration():
    pytest.importorskip("ray.serve")
    from specdec.deploy import app, scale
    from specdec.deploy.replica import replica_spec

    assert app.ScaleConfig is scale.ScaleConfig  # still importable from where it lived
    config = serve(*TUNED, "--threads-per-replica", "2", "--api-key", "sk-flag", keys=True)
    spec = replica_spec(config)
    assert spec.config.engine == config.engine and spec.config.models.threads == 2
    assert spec.config == replace(config, models=replace(config.models, threads=2),
                                  server=replace(config.server, api_key=None, api_keys=()))
    assert b"sk-flag" not in pickle.dumps(spec)


def imported_specdec_modules(path: Path) -> set[str]:
    """Every specdec module `path` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("specdec.")}


def test_no_import_cycle_between_the_deployment_and_the_server_command():
    modules = {name: SRC / (name.replace(".", "/") + ".py")
               for name in ("specdec.deploy.app", "specdec.deploy.cli", "specdec.server.cli")}
    edges = {name: imported_specdec_modules(path) & set(modules) for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in edges[start])

    assert not [name for name in modules if reaches(name, name)], edges
