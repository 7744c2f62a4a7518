"""The `specdec` command line. Each subcommand lives in its own module; this file only wires them.

Errors meant for the user (SpecdecError) print one line and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from functools import partial

from specdec.drafters import registry as drafting_methods
from specdec.types import SpecdecError

# Subcommands in other modules: each exposes add_arguments(parser) and run(args) -> int.
PLUGIN_COMMANDS = {
    "serve": ("specdec.server.cli", "run the OpenAI-compatible server"),
    "bench": ("specdec.bench.cli", "benchmark methods side by side on Spec-Bench or your prompts"),
    "batch": ("specdec.client.batch_cli", "run a JSONL batch against an OpenAI-compatible endpoint"),
}


def _cmd_models(args: argparse.Namespace) -> int:
    from specdec.models.pull import pull, verify_model_file
    from specdec.models.registry import DEFAULT_PAIR, default_path

    if args.models_command == "pull":
        for role, spec in DEFAULT_PAIR.items():
            path = pull(spec, force=args.force)
            print(f"{role}: {path}")
        return 0
    for role, spec in DEFAULT_PAIR.items():
        path = default_path(spec)
        try:
            verify_model_file(path, spec, check_hash=False)
            state = f"cached  {spec.size / 2**20:8.1f} MiB"
        except SpecdecError:
            state = "missing " + " " * 13
        print(f"{role:7s} {spec.name:40s} {state}  {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from specdec import runtime
    from specdec.config_flags import config_from_args
    from specdec.types import GenerationRequest, SamplingParams

    if args.max_tokens is not None and args.max_tokens < 0:
        raise SpecdecError("--max-tokens must be >= 0.")
    config = config_from_args(args)
    spec, models = config.server.spec, config.models
    if not drafting_methods.wants_draft(spec.method):
        models = models.without_draft()
    engine = runtime.load_engine(models, engine=config.engine)
    try:
        if drafting_methods.calibrated(spec.method):
            from specdec.machine_profile import load_or_calibrate

            cost, measured = load_or_calibrate(engine)
            if measured:
                print(f"specdec: calibrated this machine for {spec.method} ({cost.summary()}); saved for the next command",
                      file=sys.stderr)
        prompt_ids = engine.encode_prompt(args.prompt, chat=args.chat)
        request = GenerationRequest(
            prompt_token_ids=tuple(prompt_ids),
            max_tokens=args.max_tokens,
            sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed),
            spec=spec,
            stop=tuple(args.stop or ()),
        )
        if args.json:
            result = engine.generate(request)
            print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats}, ensure_ascii=False))
            return 0
        stats = {}
        for event in engine.stream(request):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            if event.stats is not None:
                stats = event.stats
        sys.stdout.write("\n")
        print(format_stats_line(stats), file=sys.stderr)
        return 0
    finally:
        engine.close()


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure each configuration's cost model (what `auto` prices its proposals with), one loaded
    at a time, in rounds; print one JSON line per configuration, then a table and the exact one to
    default to."""
    from specdec import runtime
    from specdec.config_flags import config_from_args
    from specdec.machine_profile import (choose, format_table, measure_configs, parse_backend_configs, save_profile,
                                         saved_choice)

    if args.rounds is not None and args.rounds < 1:
        raise SpecdecError("--rounds must be at least 1.")
    if args.if_missing:
        current = saved_choice()
        if current is not None:
            print(f"specdec calibrate: this machine's profile is current (default {current.label}); nothing to do",
                  file=sys.stderr)
            return 0
    config = config_from_args(args)
    models = config.models
    configs = parse_backend_configs(args.configs) if args.configs else [models.backend]
    if args.if_missing and sum(each.exact for each in configs) < 2:
        print("specdec calibrate: fewer than two exact configurations installed; nothing to choose between",
              file=sys.stderr)
        return 0
    rounds = args.rounds or (3 if len(configs) > 1 else 1)
    entries = measure_configs(models, configs, partial(runtime.load_engine, engine=config.engine), rounds,
                              progress=lambda line: print(f"specdec calibrate: {line}", file=sys.stderr, flush=True))
    for entry in entries:
        print(json.dumps(entry), flush=True)
    measured = [entry for entry in entries if "error" not in entry]
    if not measured:
        raise SpecdecError("; ".join(f"{entry['config']}: {entry['error']}" for entry in entries))
    chosen = choose(entries)
    print()
    print(format_table(entries, chosen))
    if args.save:
        print(f"specdec calibrate: saved to {save_profile(entries, chosen)}", file=sys.stderr)
    return 0


def format_stats_line(stats: dict) -> str:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    return (
        f"[{stats['method']}] {stats['generated_tokens']} tokens, "
        f"{fmt(stats['tokens_per_second'], '.2f')} tok/s decode, "
        f"prompt {stats['prompt_tokens']} tokens in {stats['prompt_seconds']:.2f}s, "
        f"acceptance {fmt(stats['acceptance_rate'], '.2f')}, "
        f"mean acceptance length {fmt(stats['mean_acceptance_length'], '.2f')}"
    )


def build_parser() -> argparse.ArgumentParser:
    from specdec.config_flags import add_method_arguments, add_model_arguments

    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding on CPU.")
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="fetch or list the default model pair")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    pull = models_commands.add_parser("pull", help="download, assemble and verify the default pair")
    pull.add_argument("--force", action="store_true", help="fetch again even if cached")
    models_commands.add_parser("list", help="show the cached models")
    models.set_defaults(handler=_cmd_models)

    generate = commands.add_parser("generate", help="generate a completion and print stats")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    add_method_arguments(generate)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    add_model_arguments(generate)
    generate.set_defaults(handler=_cmd_generate)

    calibrate = commands.add_parser("calibrate", help="measure this machine's cost model per backend configuration "
                                                      "and choose the fastest exact one")
    calibrate.add_argument("--configs", help="comma-separated configurations to measure one after another, e.g. "
                                             "ik_llama.cpp,llama.cpp,llama.cpp:inexact,torch:float32 (each takes "
                                             ":inexact), all (every one whose libraries are installed) or exact "
                                             "(their exact ones); default: the one --backend, --dtype and --inexact name")
    calibrate.add_argument("--save", action="store_true",
                           help="save the measurements and the chosen exact configuration to "
                                "$SPECDEC_HOME/machine_profile.json (default ~/.cache/specdec): commands given no "
                                "--backend then use that choice on this machine")
    calibrate.add_argument("--if-missing", action="store_true",
                           help="do nothing if this machine already has a profile measured with this specdec version, "
                                "or if there is only one exact configuration to choose from (make serve uses it)")
    calibrate.add_argument("--rounds", type=int, default=None,
                           help="calibrations per configuration, taken in turn, medians kept (default 3 when "
                                "comparing configurations, else 1): a VM's speed drifts between calibrations")
    add_model_arguments(calibrate)
    calibrate.set_defaults(handler=_cmd_calibrate)

    for name, (module_name, help_text) in PLUGIN_COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # that part of specdec is not built yet
            raise
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
