"""`specdec bench`: measure every method on the same prompts and write records and a report.

    specdec bench --dataset spec-bench --per-category 5 --max-tokens 128 \
        --methods off,ngram,draft --num-draft-tokens 2,4 --out bench-out
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from specdec.backends.base import default_threads
from specdec.backends.registry import TORCH, BackendConfig
from specdec.bench import sessions
from specdec.bench.datasets import SPEC_BENCH, load_prompts, spec_bench_path
from specdec.bench.peers import (HF_ASSISTED, LLAMA_SERVER, RUN, parse_peers, peer_status, run_hf_assisted,
                                 run_llama_server)
from specdec.bench.rates import add_rate_arguments
from specdec.bench.records import RECORDS_FILE, RecordFile
from specdec.bench.report import build_report
from specdec.bench.runner import (SOURCE, BenchSettings, Runner, compared_source, on_backend, parse_bench_configs,
                                  pending)
from specdec.drafters.registry import wants_draft
from specdec.types import DEFAULT_NUM_DRAFT_TOKENS, SpecdecError

META_FILE = "meta.json"
# Settings a resumed run must share with the run it continues (records would not be comparable).
RESUME_FIXED = ("dataset", "max_tokens", "temperature", "seed", "model", "draft_model", "backend", "dtype",
                "compare_backends")
COMPARED_STATUS = "run in the same process, interleaved per prompt with specdec's configurations"


def _split(values) -> list[str]:
    """["a,b", "c"] -> ["a", "b", "c"]: lists may be given comma- or space-separated."""
    return [item.strip() for value in values or () for item in str(value).split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.config_flags import add_model_arguments

    parser.add_argument("--dataset", default=SPEC_BENCH,
                        help="spec-bench (read from $SPECDEC_SPEC_BENCH or ../shared/bench/), or a JSONL file "
                             "with `prompt`, `messages` or `turns` per line and optional `category`")
    parser.add_argument("--categories", nargs="+", help="only these categories (comma- or space-separated)")
    parser.add_argument("--per-category", type=int, default=None,
                        help="the first N prompts of each category, in file order")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per generation (default 128)")
    parser.add_argument("--methods", default="off,ngram,draft,auto",
                        help="comma-separated methods, each `method` or `method:kK` (default off,ngram,draft,auto; "
                             "off always runs)")
    parser.add_argument("--num-draft-tokens", default=None,
                        help="comma-separated K values; each speculative method runs once per K, labelled method:kK "
                             "(default: the engine's default K, labelled by the method name)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed when temperature > 0 (plus the repeat index)")
    parser.add_argument("--tenant-history", action="store_true",
                        help="give `auto` a tenant history: the run's earlier prompts and their `off` outputs "
                             "(default: every generation starts with none)")
    parser.add_argument("--repeats", type=int, default=1, help="measured generations per (prompt, configuration)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up rounds over all configurations (default 1)")
    parser.add_argument("--out", default="bench-out", help="output folder: records.jsonl, report.md, report.json, charts")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out: measure only the (prompt, configuration, repeat) not yet recorded")
    parser.add_argument("--peer", action="append", default=[], metavar="PEER",
                        help="also measure llama-server=PATH (llama.cpp's server binary) or hf-assisted (repeatable)")
    parser.add_argument("--compare-backend", action="append", default=[], metavar="BACKEND",
                        help="also run every configuration on this backend configuration's engine (a label, e.g. llama.cpp or "
                             "ik_llama.cpp:repacked), loaded beside the first and "
                             "interleaved with it per prompt (repeatable; labelled specdec@BACKEND:method)")
    parser.add_argument("--compare-methods", default=None, metavar="METHODS",
                        help="the configurations run on each --compare-backend, as --methods (default: the same; "
                             "`off` alone compares plain decoding only); off always runs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    server = parser.add_argument_group("server mode (through HTTP: what `make serve` gives; bench/serving.py)")
    server.add_argument("--server", action="store_true",
                        help="measure `specdec serve` through HTTP at each --concurrency (streaming, waves of concurrent "
                             "requests), with --peer llama-server=PATH as llama.cpp's server on the same prompts")
    server.add_argument("--concurrency", default="1,2,4,8", help="streams at once, per level (default 1,2,4,8)")
    server.add_argument("--serve-args", default="", help="extra `specdec serve` flags, e.g. '--inexact'")
    server.add_argument("--engine-baseline", action="store_true",
                        help="also run each method at one stream on an engine in this process, as `specdec generate` "
                             "does, interleaved with the HTTP requests (the server's tax)")
    server.add_argument("--llama-server-specs", default="plain,ngram-simple:k3",
                        help="llama-server configurations: plain, ngram-simple:kK, draft:kK (default plain,ngram-simple:k3)")
    add_rate_arguments(parser)
    sessions.add_arguments(parser)
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.sessions is not None and args.request_rate is not None:
        raise SpecdecError("--sessions and --request-rate are separate runs: give one of them.")
    if args.request_rate is not None:
        from specdec.bench import rates

        return rates.run(args)
    if args.sessions is not None:
        return sessions.run_cli(args)
    return run_server_bench(args) if args.server else run_bench(args)


def run_server_bench(args: argparse.Namespace) -> int:
    from specdec.bench import serving

    try:
        levels = sorted({int(level) for level in _split([args.concurrency])})
    except ValueError:
        raise SpecdecError("--concurrency takes comma-separated integers, e.g. 1,2,4,8.") from None
    if not levels or levels[0] < 1 or args.repeats < 1:
        raise SpecdecError("--concurrency levels and --repeats must be at least 1.")
    methods = [method for method, _, _ in (m.partition(":") for m in _split([args.methods]))]
    prompts = load_prompts(args.dataset, _split(args.categories) or None, args.per_category)
    llama_server = parse_peers(args.peer).get(LLAMA_SERVER)
    target, draft = _model_paths(args, need_draft=True)
    out = Path(args.out)
    engine = None
    if args.engine_baseline:
        from specdec.config_flags import config_from_args
        from specdec.runtime import load_engine

        config = config_from_args(args)
        engine = load_engine(config.models, engine=config.engine)
        engine.calibrate()  # as the server does before it serves
    try:
        rows = serving.run(prompts, list(dict.fromkeys(methods)), levels, args.max_tokens, args.repeats, out,
                           shlex.split(args.serve_args), llama_server, _split([args.llama_server_specs]), target, draft,
                           engine)
    finally:
        if engine is not None:
            engine.close()
    (out / META_FILE).write_text(json.dumps({"command": "specdec " + shlex.join(sys.argv[1:]), "machine": _machine(),
                                             "prompts": len(prompts), "levels": levels, "max_tokens": args.max_tokens,
                                             "repeats": args.repeats}, indent=2) + "\n", encoding="utf-8")
    print(serving.format_table(rows))
    print(f"specdec bench: server report in {out / 'server-report.md'}", file=sys.stderr)
    return 0


def run_bench(args: argparse.Namespace, engine_factory: Optional[Callable] = None) -> int:
    """The bench command; engine_factory(args) builds the engine (default: specdec.runtime.load_engine)."""
    if args.max_tokens is None or args.max_tokens < 1:
        raise SpecdecError("--max-tokens must be at least 1.")
    if args.repeats < 1:
        raise SpecdecError("--repeats must be at least 1.")
    if args.warmup < 0:
        raise SpecdecError("--warmup must be >= 0.")
    if args.temperature < 0:
        raise SpecdecError("--temperature must be >= 0.")
    from specdec.config_flags import config_from_args

    config = config_from_args(args)
    models = config.models  # the backend is part of the run's settings: named before they are recorded
    try:
        ks = [int(k) for k in _split([args.num_draft_tokens])] if args.num_draft_tokens else None
    except ValueError:
        raise SpecdecError("--num-draft-tokens takes comma-separated integers, e.g. 2,4.") from None
    own = parse_bench_configs(_split([args.methods]), ks)
    compare = list(dict.fromkeys(_split(args.compare_backend)))
    for backend in compare:
        if BackendConfig.parse(backend).label == models.backend.label:  # an unknown name fails here, before loading
            raise SpecdecError(f"--compare-backend {backend} is already the backend measured.")
    theirs = parse_bench_configs(_split([args.compare_methods]), ks) if args.compare_methods is not None else own
    configs = own + [config for backend in compare for config in on_backend(theirs, backend)]
    need_draft = any(wants_draft(c.method) for c in configs)
    if need_draft and args.no_draft:
        raise SpecdecError("--no-draft contradicts the draft method in --methods.")
    if not need_draft:
        models = models.without_draft()  # load the draft model only when a draft configuration runs
        config = replace(config, models=models)
    prompts = load_prompts(args.dataset, _split(args.categories) or None, args.per_category)
    peers = parse_peers(args.peer)
    settings = BenchSettings(args.max_tokens, args.temperature, args.repeats, args.warmup, args.seed, args.tenant_history)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with RecordFile(out / RECORDS_FILE, resume=args.resume) as records:  # refuses to overwrite a run
        meta = _merge_meta(out / META_FILE, _run_meta(args, models, compare, prompts, configs), args.resume)
        if records.dropped_torn_line:
            print(f"specdec bench: dropped a torn last line from {records.path}", file=sys.stderr)
        try:
            _measure(args, config, compare, engine_factory, prompts, configs, settings, records, meta, peers,
                     need_draft, out)
        except KeyboardInterrupt:
            build_report(records.records, meta, _statuses(peers, compare), out)
            print(f"specdec bench: interrupted; partial report in {out / 'report.md'}; "
                  "run again with --resume to finish", file=sys.stderr)
            raise
        build_report(records.records, meta, _statuses(peers, compare), out)
    print(f"specdec bench: report in {out / 'report.md'}", file=sys.stderr)
    return 0


def _statuses(peers: dict, compare: list[str]) -> dict[str, str]:
    """The peers' status lines, and the compared backends' (reported beside the peers)."""
    return {**peer_status(peers), **{compared_source(backend): COMPARED_STATUS for backend in compare}}


def _measure(args, config, compare, engine_factory, prompts, configs, settings, records, meta, peers, need_draft,
             out) -> None:
    """Our configurations, on every compared backend too (the engines are loaded only if some
    are still missing), then the peers."""
    progress = not args.no_progress
    models = config.models
    if pending(prompts, configs, settings.repeats, records):
        load = engine_factory or (lambda models: _load_engine(models, config.engine))
        engine = load(models)
        compared = {}
        try:
            for backend in compare:
                config = BackendConfig.parse(backend)  # a label: ik_llama.cpp:repacked, llama.cpp:inexact
                config = config if models.backend.exact else replace(config, exact=False)
                compared[compared_source(backend)] = load(models.with_backend(config))
            meta["engine"] = {"target": engine.target.describe(),
                              "draft": engine.draft.describe() if engine.draft is not None else None}
            meta["compared_engines"] = {source: other.target.describe() for source, other in compared.items()}
            _write_meta(out / META_FILE, meta)
            counts = Runner(engine, configs, settings, records, progress=progress, compared=compared).run(prompts)
        finally:
            for each in (engine, *compared.values()):
                each.close()  # before any peer starts: they must not share the cores or the memory
        print(f"specdec bench: {counts['measured']} generations measured, {counts['failed']} failed, "
              f"{counts['skipped']} already recorded", file=sys.stderr)
    if peers.get(LLAMA_SERVER):
        target, draft = _model_paths(args, need_draft)
        draft_ks = [c.num_draft_tokens for c in configs if c.method == "draft" and c.source == SOURCE]
        ngram_ks = [c.num_draft_tokens for c in configs if c.method == "ngram" and c.source == SOURCE]
        threads = args.threads or default_threads()  # the same threads as our engine's default
        run_llama_server(peers[LLAMA_SERVER], prompts, draft_ks, settings, records, target, draft,
                         out / "logs", _peer_ctx_size(args), threads, progress, ngram_ks=ngram_ks)
    if peer_status(peers)[HF_ASSISTED] == RUN:
        target, draft = _model_paths(args, need_draft)
        draft_ks = [c.num_draft_tokens for c in configs if c.method == "draft" and c.source == SOURCE]
        ngram_ks = [c.num_draft_tokens for c in configs if c.method == "ngram" and c.source == SOURCE] or \
            [DEFAULT_NUM_DRAFT_TOKENS]
        run_hf_assisted(prompts, draft_ks, ngram_ks, settings, records, target, draft,
                        args.dtype or TORCH.dtypes[0], _peer_ctx_size(args), args.threads or default_threads(), progress=progress)


def _peer_ctx_size(args: argparse.Namespace) -> int:
    """The peers' context per slot: --ctx-size where given, else the floor auto never goes below
    (every benchmark prompt fits it; a peer sizes its own cache)."""
    from specdec.backends.context_size import FLOOR

    return args.ctx_size or FLOOR


def _load_engine(models, engine_config):
    from specdec.runtime import load_engine

    return load_engine(models, engine=engine_config)


def _model_paths(args: argparse.Namespace, need_draft: bool) -> tuple[str, Optional[str]]:
    from specdec.models.registry import DRAFT, TARGET
    from specdec.runtime import resolve_model

    target = str(resolve_model(args.model, TARGET))
    draft = str(resolve_model(args.draft_model, DRAFT)) if need_draft else None
    return target, draft


def _file_sha256(path: str) -> Optional[str]:
    try:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    except OSError:
        return None


def _models_meta(args: argparse.Namespace, need_draft: bool) -> dict:
    """Model files with sha256 (the registry's for the verified defaults, computed for user files)."""
    from specdec.models.registry import DRAFT, TARGET

    models = {}
    for role, given, spec, wanted in (("target", args.model, TARGET, True), ("draft", args.draft_model, DRAFT, need_draft)):
        if not wanted:
            continue
        if given:
            models[role] = {"path": str(given), "sha256": _file_sha256(given)}
        else:
            models[role] = {"path": f"default: {spec.filename}", "sha256": spec.sha256}
    return models


def _machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "cores_usable": default_threads()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return info


def _run_meta(args: argparse.Namespace, models, compare, prompts, configs) -> dict:
    dataset = str(spec_bench_path()) if args.dataset == SPEC_BENCH else args.dataset
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "specdec " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None,
        "dataset": args.dataset,
        "dataset_path": dataset,
        "prompts": len(prompts),
        "categories": list(dict.fromkeys(p.category for p in prompts)),
        "per_category": args.per_category,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "tenant_history": args.tenant_history,
        "configs": [c.label for c in configs],
        "model": args.model,
        "draft_model": args.draft_model,
        "backend": models.backend.backend,
        "dtype": models.backend.dtype,
        "compare_backends": compare,
        "compare_methods": args.compare_methods,
        "models": _models_meta(args, any(c.method == "draft" for c in configs)),
        "machine": _machine(),
    }


def _merge_meta(path: Path, meta: dict, resume: bool) -> dict:
    """On resume, refuse settings that would make old and new records incomparable."""
    if resume and path.exists():
        previous = json.loads(path.read_text(encoding="utf-8"))
        changed = [k for k in RESUME_FIXED if k in previous and previous[k] != meta[k]]
        if changed:
            raise SpecdecError(f"--resume with different {', '.join(changed)} than the run in {path.parent}; "
                               "use the same settings or another --out.")
        meta["first_started"] = previous.get("first_started", previous.get("date"))
        meta["configs"] = list(dict.fromkeys([*previous.get("configs", []), *meta["configs"]]))
    else:
        meta["first_started"] = meta["date"]
    _write_meta(path, meta)
    return meta


def _write_meta(path: Path, meta: dict) -> None:
    path.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
