"""specdec's one configuration: every setting of every command, in sections, and its one loader.

    SpecdecConfig
      models          ModelConfig   (backends/registry.py): files, context, threads
        backend       BackendConfig (backends/registry.py): which library, dtype, exact, repacked
      engine          EngineConfig  (engine/engine.py): n-gram sizes, prefix cache, cross-request history
        policy        PolicyConfig  (drafters/policy/config.py): `auto`'s tunables; the section [policy]
      server          ServerConfig  (server/config.py): address, limits, timeouts, keys
        spec          SpecConfig    (types.py): the method and tokens per round
      scale           ScaleConfig   (deploy/scale.py): Ray Serve replicas and autoscaling
      slots           sequences generated at once (`--parallel`)

Each setting is a key, "section.field" ("slots" alone at the top). `load_config` merges, each
over the one before: the dataclasses' defaults < a TOML file < SPECDEC_<SECTION>_<FIELD> in the
environment < command-line flags < `--set KEY=VALUE`, converts each value by its field's type and
validates the whole. No argparse here (specdec/config_flags.py translates the flags) and no Ray.
"""
from __future__ import annotations

import difflib
import os
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from specdec.backends.registry import BackendConfig, ModelConfig
from specdec.deploy.scale import ScaleConfig
from specdec.drafters import registry as drafting_methods
from specdec.drafters.policy.config import PolicyConfig
from specdec.engine.engine import EngineConfig
from specdec.models.reduced_vocabulary import ROW_MULTIPLE
from specdec.server.config import ServerConfig
from specdec.types import SpecdecError

__all__ = ["ENV_PREFIX", "SECRETS", "SECTIONS", "SETTINGS", "BackendConfig", "EngineConfig", "ModelConfig",
           "PolicyConfig", "ScaleConfig", "ServerConfig", "SpecdecConfig", "load_config", "parse_assignment"]

ENV_PREFIX = "SPECDEC_"
FLAGS = "the command line"  # the one source the keys may come from (besides their own variables and files)
# Never from a file, the generic variables or --set: what those hold may end up in what Ray stores
# or a log shows. Keys come from --api-key, a keys file or SPECDEC_API_KEY(S) (server/tenants.py).
SECRETS = frozenset({"server.api_key", "server.api_keys", "server.metrics_key"})
SECRET_HINT = ("API keys go in a keys file (--api-keys-file, or server.api_keys_file, or SPECDEC_API_KEYS_FILE), "
               "in SPECDEC_API_KEYS or SPECDEC_API_KEY, or in --api-key; the metrics key in SPECDEC_METRICS_KEY "
               "or --metrics-key")


@dataclass(frozen=True)
class SpecdecConfig:
    """Everything a command needs; frozen, so it pickles whole to each Ray replica."""

    models: ModelConfig
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    slots: int = 4  # sequences generated at once (`specdec serve --parallel`; each Ray replica's)

    @property
    def policy(self) -> PolicyConfig:
        return self.engine.policy

    def validate(self) -> None:
        """Every section's checks, each error one line."""
        if self.slots < 1:
            raise SpecdecError("--parallel must be >= 1.")
        self.server.validate()
        method = drafting_methods.get(self.server.spec.method)
        if method is not None and method.needs_draft and not self.models.load_draft:
            raise SpecdecError(f"--method {method.name} needs a draft model; drop --no-draft.")
        _validate_models(self.models)
        _validate_engine(self.engine)
        self.scale.validate()


def _validate_models(models: ModelConfig) -> None:
    if models.ctx_size is not None and models.ctx_size < 16:
        raise SpecdecError("--ctx-size must be at least 16.")
    if models.threads is not None and models.threads < 1:
        raise SpecdecError("--threads must be at least 1.")
    if models.draft_vocabulary < 0 or models.draft_vocabulary % ROW_MULTIPLE:
        raise SpecdecError(f"--draft-vocabulary must be 0 (all tokens) or a positive multiple of {ROW_MULTIPLE}.")


def _validate_engine(engine: EngineConfig) -> None:
    if not 1 <= engine.ngram_min <= engine.ngram_max:
        raise SpecdecError("engine.ngram_min and engine.ngram_max need 1 <= ngram_min <= ngram_max.")
    if engine.cache_ram_mib is not None and engine.cache_ram_mib < 0:
        raise SpecdecError("--cache-ram takes MiB, 0 or more (0: no prompt starts kept in host memory).")


# -- the keys ---------------------------------------------------------------------------------------
# A nested dataclass is a section named by its path, except the policy: a section of its own to
# its users, held by the engine (the engine builds `auto` with it).
SECTION_NAMES = {"engine.policy": "policy"}
# Settled together by runtime.backend_config (the saved per-machine choice when none is named).
BACKEND_SECTION = "models.backend"


def _walk(cls: type, prefix: str, sections: dict[str, tuple[str, ...]], settings: dict[str, Any],
          path: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for each in fields(cls):
        name = f"{prefix}{each.name}"
        hint = hints[each.name]
        if is_dataclass(hint):
            section = SECTION_NAMES.get(name, name)
            sections[section] = (*path, each.name)
            _walk(hint, section + ".", sections, settings, (*path, each.name))
        else:
            settings[name] = hint


SECTIONS: dict[str, tuple[str, ...]] = {}  # section -> its attributes' path from SpecdecConfig
SETTINGS: dict[str, Any] = {}  # key -> the field's type
_walk(SpecdecConfig, "", SECTIONS, SETTINGS)


def env_name(key: str) -> str:
    """"engine.ngram_max" -> "SPECDEC_ENGINE_NGRAM_MAX"."""
    return ENV_PREFIX + key.replace(".", "_").upper()


# -- values -----------------------------------------------------------------------------------------
NONE_WORDS = ("", "none", "null")
# Optional keys whose None means "chosen for this machine": they take the word auto too.
AUTO_KEYS = frozenset({"models.ctx_size"})
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def describe(hint: Any) -> str:
    """A type as the error messages name it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return " or ".join([describe(arg) for arg in args if arg is not type(None)] + ["none"])
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a comma-separated list of ({describe(args[0])})"
        return f"{len(args)} comma-separated values ({', '.join(describe(arg) for arg in args)})"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def convert(key: str, value: Any, hint: Any) -> Any:
    """`value` (text from the environment or --set, a TOML value, or a flag's) as `hint`; raises ValueError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        if value is None or (isinstance(value, str) and value.strip().lower() in NONE_WORDS):
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return convert(key, value, inner)
    if origin is tuple:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(key, item, args[0]) for item in value)
        if len(value) != len(args):
            raise ValueError
        return tuple(convert(key, item, arg) for item, arg in zip(value, args))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
            return value.strip().lower() in TRUE_WORDS
        raise ValueError
    if isinstance(value, bool):
        raise ValueError  # never 1 or 0 for a number
    if hint is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            return int(value.strip())
        raise ValueError
    if hint is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())
        raise ValueError
    if hint is str and isinstance(value, str):
        return value
    raise ValueError


def _unknown(key: str, source: str) -> SpecdecError:
    section = key.rpartition(".")[0]
    if section and section not in SECTIONS:
        return SpecdecError(f"unknown section {section!r} in {key!r} ({source}); sections: {', '.join(SECTIONS)}.")
    close = difflib.get_close_matches(key, SETTINGS, 1)
    return SpecdecError(f"unknown setting {key!r} ({source})" + (f"; did you mean {close[0]!r}?" if close else "."))


def setting(key: str, value: Any, source: str) -> Any:
    """One key's value, checked and converted; every error one line naming the key and its type."""
    if key not in SETTINGS:
        raise _unknown(key, source)
    if key in SECRETS and source != FLAGS:
        raise SpecdecError(f"{key} cannot be set in {source}: {SECRET_HINT}.")
    if key in AUTO_KEYS and isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return convert(key, value, SETTINGS[key])
    except (ValueError, TypeError):
        kind = describe(SETTINGS[key]).replace(" or none", " or auto") if key in AUTO_KEYS else describe(SETTINGS[key])
        raise SpecdecError(f"{key} takes {kind}, not {value!r} ({source}).") from None


# -- the sources ------------------------------------------------------------------------------------
def parse_assignment(text: str) -> tuple[str, str]:
    """"engine.ngram_max=4" -> ("engine.ngram_max", "4")."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise SpecdecError(f"--set takes KEY=VALUE (e.g. engine.ngram_max=4), not {text!r}.")
    return key.strip(), value.strip()


def flatten(table: Mapping[str, Any], source: str, prefix: str = "") -> dict[str, Any]:
    """A TOML document's (or a Serve config's) nested tables as keys: {"engine": {"ngram_max": 4}}
    -> {"engine.ngram_max": 4}."""
    flat: dict[str, Any] = {}
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            if key not in SECTIONS:
                raise SpecdecError(f"unknown section {key!r} ({source}); sections: {', '.join(SECTIONS)}.")
            flat.update(flatten(value, source, key + "."))
        else:
            flat[key] = value
    return flat


def read_toml(path: Union[str, Path]) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise SpecdecError("--config needs Python 3.11 or later (tomllib), or `pip install tomli`.") from None
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise SpecdecError(f"cannot read the configuration file {str(path)!r}: {exc.strerror or exc}.") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecdecError(f"the configuration file {str(path)!r} is not TOML: {exc}.") from None


def from_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The SPECDEC_<SECTION>_<FIELD> variables (and SPECDEC_SLOTS). A variable under a section's
    prefix that names no field is an error, not a silent no-op."""
    prefixes = sorted(((env_name(section) + "_", section) for section in SECTIONS), key=lambda p: -len(p[0]))
    top = {env_name(key): key for key in SETTINGS if "." not in key}
    found: dict[str, str] = {}
    for name, value in environ.items():
        if name in top:
            found[top[name]] = value
            continue
        # The longest section first, then shorter ones: SPECDEC_MODELS_BACKEND_BY_RULE is models.backend_by_rule.
        candidates = [f"{section}.{name[len(prefix):].lower()}" for prefix, section in prefixes if name.startswith(prefix)]
        if not candidates:
            continue
        key = next((key for key in candidates if key in SETTINGS), None)
        if key is None:
            raise _unknown(candidates[0], f"${name}")
        if key in SECRETS:
            raise SpecdecError(f"${name} is not read: {SECRET_HINT}.")
        found[key] = value
    return found


# -- the loader -------------------------------------------------------------------------------------
def load_config(*, file: Union[str, Path, None] = None, mapping: Optional[Mapping[str, Any]] = None,
                environ: Optional[Mapping[str, str]] = None, flags: Optional[Mapping[str, Any]] = None,
                sets: Sequence[str] = (), keys: bool = False, ray: Optional[bool] = None) -> SpecdecConfig:
    """The configuration, each source over the one before: defaults < `file` (TOML) < `mapping`
    (the same layout, e.g. a Serve config's args) < `environ`'s SPECDEC_<SECTION>_<FIELD> < `flags`
    (key -> value, from config_flags.py) < `sets` ("KEY=VALUE"). `keys`: read the server's API keys
    (commands that serve). `ray=False`: a server that runs without Ray, which refuses Ray's settings."""
    environ = os.environ if environ is None else environ
    layers = [(f"the configuration file {str(file)!r}", flatten(read_toml(file), str(file)) if file else {}),
              ("the Serve config's args", flatten(mapping or {}, "the Serve config's args")),
              ("the environment", from_environment(environ)),
              (FLAGS, dict(flags or {})),
              ("--set", dict(parse_assignment(text) for text in sets))]
    settings: dict[str, Any] = {}
    for source, layer in layers:
        for key, value in layer.items():
            settings[key] = setting(key, value, source)
    if ray is False:  # before the backend is looked for: the mistake is the Ray setting
        _apply(ScaleConfig(), "scale.", settings).refuse_without_ray()
    config = assemble(settings)
    if keys:
        config = with_keys(config, settings.get("server.api_key"), environ, settings.get("server.metrics_key"))
    config.validate()
    return config


def assemble(settings: Mapping[str, Any]) -> SpecdecConfig:
    """The dataclasses with `settings` applied, and what follows from them where not set: the
    backend (runtime.backend_config), the served model's name and the Host names answered."""
    from specdec.runtime import backend_config, chosen_by_rule
    from specdec.server.hosts import allowed_hosts_for

    named = settings.get(f"{BACKEND_SECTION}.backend")
    backend = backend_config(named, settings.get(f"{BACKEND_SECTION}.dtype"),
                             settings.get(f"{BACKEND_SECTION}.exact", True),
                             settings.get(f"{BACKEND_SECTION}.repacked", False))
    config = _apply(SpecdecConfig(ModelConfig(backend, backend_by_rule=chosen_by_rule(named))), "", settings)
    server = config.server
    if "server.served_model_name" not in settings:
        server = replace(server, served_model_name=default_served_name(config.models.target))
    server = replace(server, allowed_hosts=allowed_hosts_for(server.host, server.allowed_hosts or ()))
    return replace(config, server=server)


def _apply(instance: Any, prefix: str, settings: Mapping[str, Any]) -> Any:
    changes = {}
    for each in fields(instance):
        name = f"{prefix}{each.name}"
        value = getattr(instance, each.name)
        if is_dataclass(value):
            section = SECTION_NAMES.get(name, name)
            if section != BACKEND_SECTION:  # settled already
                changes[each.name] = _apply(value, section + ".", settings)
        elif name in settings:
            changes[each.name] = settings[name]
    try:
        return replace(instance, **changes)
    except ValueError as exc:  # a section's own check (PolicyConfig's)
        raise SpecdecError(str(exc)) from None


def default_served_name(target: Optional[str]) -> str:
    """The name clients send: the target file's stem, or the default target's."""
    if target:
        return Path(target).stem
    from specdec.models.registry import TARGET, default_path

    return default_path(TARGET).stem


def with_keys(config: SpecdecConfig, flag_key: Optional[str], environ: Mapping[str, str],
              flag_metrics_key: Optional[str] = None) -> SpecdecConfig:
    """The server's API keys: --api-key (else $SPECDEC_API_KEY), the keys file (else
    $SPECDEC_API_KEYS_FILE) and $SPECDEC_API_KEYS, and the metrics key (--metrics-key, else
    $SPECDEC_METRICS_KEY), as server/tenants.py reads them."""
    from specdec.server.tenants import configured_keys, configured_metrics_key

    api_key, api_keys = configured_keys(flag_key, config.server.api_keys_file, dict(environ))
    metrics_key = configured_metrics_key(flag_metrics_key, api_key, api_keys, dict(environ))
    return replace(config, server=replace(config.server, api_key=api_key, api_keys=api_keys, metrics_key=metrics_key))
