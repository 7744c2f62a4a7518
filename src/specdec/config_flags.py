"""Command-line flags -> the configuration (specdec/config.py), in one place.

A flag that sets a configuration key is declared with `action=Setting` (or `Switch`) and its
`key`; given on the command line, it notes key = value on the parsed namespace, and only then:
a flag left at its default never overrides the file or the environment. `config_from_args` hands
those, `--config FILE` and the `--set KEY=VALUE`s to `load_config`. Every command that builds an
engine or a server takes the model arguments below, and with them --config and --set.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Optional

from specdec.backends.registry import REGISTRY, ModelConfig
from specdec.config import SETTINGS, SpecdecConfig, load_config
from specdec.drafters.registry import method_names
from specdec.types import SpecConfig

DTYPES = sorted({dtype for entry in REGISTRY.values() for dtype in entry.dtypes})
GIVEN = "config_settings"  # the namespace attribute holding the keys the command line set
SPEC = SpecConfig()


def note(namespace: argparse.Namespace, key: str, value: Any) -> None:
    given = getattr(namespace, GIVEN, None)
    if given is None:
        given = {}
        setattr(namespace, GIVEN, given)  # copied onto the command's namespace with the subcommand's values
    given[key] = value


class Setting(argparse.Action):
    """A flag that sets configuration `key` to its value (through `to_value`); stored under its
    own name too, as argparse's `store` would."""

    def __init__(self, option_strings, dest, key: str, to_value: Callable[[Any], Any] = lambda value: value,
                 **kwargs):
        if key not in SETTINGS:
            raise ValueError(f"unknown configuration key {key!r}")
        super().__init__(option_strings, dest, **kwargs)
        self.key, self.to_value = key, to_value

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        note(namespace, self.key, self.to_value(values))


class Switch(Setting):
    """A flag without a value (argparse's `store_true`) that sets configuration `key` to `value`."""

    def __init__(self, option_strings, dest, key: str, value: Any = True, default=False, help=None):
        super().__init__(option_strings, dest, key, to_value=lambda _: value, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        note(namespace, self.key, self.to_value(values))


def context_size(text: str) -> Optional[int]:
    """--ctx-size's value: a number of tokens, or auto (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of tokens or auto, not {text!r}") from None


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("configuration (docs/usage.md#configuration)")
    group.add_argument("--config", metavar="FILE",
                       help="a TOML file of settings ([models], [models.backend], [engine], [policy], [server], "
                            "[server.spec], [scale]); SPECDEC_<SECTION>_<FIELD> variables override it, flags "
                            "override those")
    group.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="any setting, over everything else (repeatable), e.g. engine.ngram_max=4, "
                            "policy.margin=0.05, server.prefill_chunk=256")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--backend", choices=list(REGISTRY), default=None, action=Setting, key="models.backend.backend",
                       help="who runs the models: " + "; ".join(f"{name}: {entry.summary}" for name, entry in REGISTRY.items())
                            + ". Default: the choice `specdec calibrate --configs all --save` made on this machine, "
                              "else specdec's ik_llama.cpp build with repacked weights, else the first installed of "
                            + ", ".join(REGISTRY))
    group.add_argument("--dtype", choices=DTYPES, default=None, action=Setting, key="models.backend.dtype",
                       help="torch backend only: weights and activations in bfloat16 (default) or float32; "
                            "without --backend, the saved choice's")
    group.add_argument("--model", action=Setting, key="models.target",
                       help="target GGUF, or for torch also a Hugging Face model folder "
                            "(default: the pulled Qwen2.5-Coder-1.5B-Instruct Q4_K_M)")
    group.add_argument("--draft-model", action=Setting, key="models.draft",
                       help="draft GGUF or, for torch, model folder (default: the pulled Qwen2.5-Coder-0.5B-Instruct "
                            "Q4_K_M)")
    group.add_argument("--no-draft", action=Switch, key="models.load_draft", value=False,
                       help="load no draft model (methods off and ngram only)")
    group.add_argument("--draft-vocabulary", type=int, default=ModelConfig.draft_vocabulary, metavar="N",
                       action=Setting, key="models.draft_vocabulary",
                       help="the draft model scores only the N most frequent tokens, a cheaper step (ik_llama.cpp "
                            "built by specdec; lossless: only proposals change); 0: all "
                            f"(default {ModelConfig.draft_vocabulary})")
    group.add_argument("--ctx-size", type=context_size, default=None, metavar="N|auto", action=Setting,
                       key="models.ctx_size",
                       help="context per slot in tokens (default auto: the model's trained length within a KV budget "
                            "of a third of the RAM, less the weights; the start-up log states both); at most the "
                            "trained length")
    group.add_argument("--threads", type=int, default=None, action=Setting, key="models.threads",
                       help="CPU threads (default: all cores)")
    group.add_argument("--repacked", action=Switch, key="models.backend.repacked",
                       help="ik_llama.cpp only: the target's weights repacked row-interleaved at load (faster at every "
                            "row count; exact at every row count with specdec's ik build, from 2 rows with PyPI's wheel, "
                            "whose one-token steps then carry a padding row); without --backend, the saved choice's")
    group.add_argument("--inexact", action=Switch, key="models.backend.exact", value=False,
                       help="LOSSY opt-in: faster kernels whose batched logits may differ from one-token steps")
    add_config_arguments(parser)


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", choices=method_names(), default=SPEC.method, action=Setting, key="server.spec.method",
                        help=f"drafter: off (plain decoding), ngram (prompt lookup), draft (small model) or auto (picks per "
                             f"round what this machine's measured costs favour); default {SPEC.method}")
    parser.add_argument("--num-draft-tokens", type=int, default=SPEC.num_draft_tokens, action=Setting,
                        key="server.spec.num_draft_tokens",
                        help=f"tokens proposed per round (default {SPEC.num_draft_tokens})")


def config_from_args(args: argparse.Namespace, *, keys: bool = False, ray: Optional[bool] = None) -> SpecdecConfig:
    """The command's configuration: its --config file, the environment, its flags and its --sets
    (config.load_config; `keys` and `ray` as there)."""
    given = getattr(args, GIVEN, {})
    if keys and given.get("server.api_key"):
        logging.getLogger("specdec.server").warning(
            "--api-key puts the key in the process list; prefer SPECDEC_API_KEY or --api-keys-file")
    if keys and given.get("server.metrics_key"):
        logging.getLogger("specdec.server").warning("--metrics-key puts the key in the process list; prefer "
                                                    "SPECDEC_METRICS_KEY")
    return load_config(file=getattr(args, "config", None), flags=given, sets=getattr(args, "set", None) or (),
                       keys=keys, ray=ray)
