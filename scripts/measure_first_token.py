"""Time to first token and decode speed through HTTP at one stream: two code trees side by side.

    .venv/bin/python scripts/measure_first_token.py --tree main=/work/main/src --tree new=src \\
        --categories mt_bench,translation,qa,math_reasoning --per-category 3 --repeats 3 --out bench-out/ttft

Starts one `specdec serve` (one slot) per tree, each pricing `auto` with the same cost model
(--cost-model, a CostModel JSON; measured here once, quietly, when not given), so the trees differ
in their code only. Per prompt and repeat, `off` and `auto` on each tree run one after another,
the order rotating. Before each prompt the machine must be quiet (other processes below 0.1 core
for 3 s); each request records the CPU other processes used meanwhile, and the summary drops a
prompt's group where any of its requests shared the machine (`--disturbed`, cores). Prints per
configuration the median TTFT, decode tok/s after the first token (as the client sees it) and
end-to-end time, and per tree the per-prompt ratios of `auto` to `off` (docs/notebook.md, "the
first token at off's time").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import httpx

from specdec.bench.datasets import SPEC_BENCH, load_prompts
from specdec.bench.serving import ServedConfig, SpecdecServer, one_request, served_model

# A `specdec serve` whose start-up calibration returns the cost model in argv[1] instead.
FIXED_COST_SERVE = """
import json, sys
from specdec.backends.cost_model import CostModel
from specdec.engine import engine as engine_module
with open(sys.argv.pop(1)) as f:
    cost = json.load(f)
engine_module.Engine.measure_costs = lambda self, slot=0, interrupted=None: CostModel.from_json(cost)
from specdec.cli import main
sys.exit(main(sys.argv[1:]))
"""
METHODS = ("off", "auto")
TICK = os.sysconf("SC_CLK_TCK")


def busy_jiffies() -> int:
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # less idle and iowait


def own_jiffies(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime of all its threads
        except OSError:
            pass
    return total


class Others:
    """The cores that processes other than `pids` used since start()."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.start()

    def start(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), busy_jiffies(), own_jiffies(self.pids)

    def cores(self) -> float:
        seconds = max(time.perf_counter() - self.t0, 1e-3)
        return ((busy_jiffies() - self.busy0) - (own_jiffies(self.pids) - self.own0)) / TICK / seconds


def measure_cost_model(path: Path) -> None:
    """A plausible cost model of the default pair, measured in this process, into `path`."""
    from specdec import runtime
    from specdec.config import load_config
    from specdec.backends.cost_model import implausibility

    engine = runtime.load_engine(load_config().models, n_slots=1)
    try:
        for _ in range(3):
            cost = engine.measure_costs()
            if implausibility(cost) is None:
                path.write_text(json.dumps(cost.to_json()))
                print("cost model:", cost.summary(), flush=True)
                return
        raise SystemExit("no plausible calibration in three tries: is the machine quiet?")
    finally:
        engine.close()


async def wait_until_quiet(others: Others) -> None:
    while True:
        others.start()
        await asyncio.sleep(3)
        if others.cores() < 0.1:
            return
        print(f"others use {others.cores():.2f} cores: waiting", flush=True)
        await asyncio.sleep(20)


async def run(args: argparse.Namespace, trees: dict[str, str], cost_path: Path) -> None:
    prompts = load_prompts(SPEC_BENCH, args.categories.split(","), args.per_category)
    servers: dict[str, SpecdecServer] = {}
    try:
        for label, tree in trees.items():
            os.environ["PYTHONPATH"] = tree
            server = SpecdecServer(1, [], args.out / f"{label}.log")
            server.command = [sys.executable, "-c", FIXED_COST_SERVE, str(cost_path), *server.command[3:]]
            servers[label] = server.__enter__()
        configs = [ServedConfig(f"{label}:{method}", server.url, method, served_model(server.url))
                   for label, server in servers.items() for method in METHODS]
        others = Others([os.getpid(), *(s.process.pid for s in servers.values() if s.process is not None)])
        async with httpx.AsyncClient(timeout=900) as client:
            for config in configs:
                await one_request(client, config, prompts[0], 16)  # warm-up
            with open(args.out / "records.jsonl", "a") as f:
                for repeat in range(args.repeats):
                    for i, prompt in enumerate(prompts):
                        shift = (repeat * len(prompts) + i) % len(configs)
                        order = configs[shift:] + configs[:shift]
                        await wait_until_quiet(others)
                        for config in order[::-1] if (repeat + i) % 2 else order:
                            others.start()
                            record = await one_request(client, config, prompt, args.max_tokens)
                            record.update(repeat=repeat, others_cores=others.cores())
                            f.write(json.dumps(record) + "\n")
                            f.flush()
                            print(config.label, prompt.id, record.get("ttft"), record.get("decode_tokens_per_second"),
                                  record.get("error") or "", f"others {record['others_cores']:.2f}", flush=True)
    finally:
        for server in servers.values():
            server.__exit__()


def quartiles(values: list[float]) -> str:
    values = sorted(values)
    if not values:
        return "-"
    n = len(values)
    return (f"{statistics.median(values):.3f} (IQR {values[n // 4]:.3f}-{values[(3 * n) // 4]:.3f}, "
            f"{values[0]:.3f}-{values[-1]:.3f}, n={n})")


def ratio_summary(pairs) -> str:
    """TTFT, decode tok/s and end-to-end time of the first of each pair over the second's."""
    decode = [a["decode_tokens_per_second"] / b["decode_tokens_per_second"] for a, b in pairs
              if a["decode_tokens_per_second"] and b["decode_tokens_per_second"]]
    return (f"TTFT {quartiles([a['ttft'] / b['ttft'] for a, b in pairs])}; decode {quartiles(decode)}; "
            f"end to end {quartiles([a['seconds'] / b['seconds'] for a, b in pairs])}")


def summarize(path: Path, disturbed: float) -> list[str]:
    """The report: printed, and written beside the records as report.md."""
    lines: list[str] = []

    def emit(line: str = "") -> None:
        lines.extend(line.split("\n"))

    records = [json.loads(line) for line in path.open()]
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        groups[(r["prompt_id"], r["repeat"])][r["config"]] = r
    labels = sorted({r["config"].split(":")[0] for r in records})
    complete = {key: g for key, g in groups.items()
                if len(g) == len(labels) * len(METHODS) and not any(r.get("error") for r in g.values())
                and max(r["others_cores"] for r in g.values()) <= disturbed}
    emit(f"{len(complete)} of {len(groups)} (prompt, repeat) groups kept: complete, no error, others <= {disturbed} cores")
    emit("| configuration | TTFT s | decode tok/s after the first token | end to end s |")
    emit("|---|---|---|---|")
    for config in sorted({c for g in complete.values() for c in g}):
        rs = [g[config] for g in complete.values()]
        emit(f"| {config} | {quartiles([r['ttft'] for r in rs])} | "
              f"{quartiles([r['decode_tokens_per_second'] for r in rs if r['decode_tokens_per_second']])} | "
              f"{quartiles([r['seconds'] for r in rs])} |")
    emit("\nper prompt and repeat, auto / off on the same tree (TTFT, decode tok/s, end-to-end time):")
    for label in labels:
        pairs = [(g[f"{label}:auto"], g[f"{label}:off"]) for g in complete.values()]
        same = sum(auto["text"] == off["text"] for auto, off in pairs)
        emit(f"- {label}: {ratio_summary(pairs)}; texts equal to off's {same}/{len(pairs)}")
        for category in sorted({a["category"] for a, _ in pairs}):
            sub = [(a, o) for a, o in pairs if a["category"] == category]
            emit(f"  - {category}: TTFT {statistics.median(a['ttft'] / o['ttft'] for a, o in sub):.3f}, "
                  f"decode {statistics.median(a['decode_tokens_per_second'] / o['decode_tokens_per_second'] for a, o in sub if a['decode_tokens_per_second'] and o['decode_tokens_per_second']):.3f}, "
                  f"end to end {statistics.median(a['seconds'] / o['seconds'] for a, o in sub):.3f} (n={len(sub)})")
    base = labels[0]
    for label in labels[1:]:
        emit(f"\nper prompt and repeat, {label} / {base}, the same method (TTFT, decode tok/s, end-to-end time):")
        for method in METHODS:
            pairs = [(g[f"{label}:{method}"], g[f"{base}:{method}"]) for g in complete.values()]
            same = sum(new["text"] == old["text"] for new, old in pairs)
            emit(f"- {method}: {ratio_summary(pairs)}; same texts {same}/{len(pairs)}")
    emit(f"\nothers' cores per request: median {statistics.median(r['others_cores'] for g in complete.values() for r in g.values()):.3f}")
    return lines


def write_meta(args: argparse.Namespace, trees: dict[str, str], cost_path: Path) -> None:
    def commit(tree: str) -> str:
        done = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return done.stdout.strip() + (" (with uncommitted changes)" if dirty else "")

    cpu = {key.strip(): value.strip() for key, value in
           (line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if ":" in line)}
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
            "trees": {label: {"src": tree, "commit": commit(tree)} for label, tree in trees.items()},
            "cost_model": json.loads(cost_path.read_text()),
            "cpu": {key: cpu.get(key) for key in ("Model name", "CPU family", "Model", "CPU(s)")}}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=SRC",
                        help="a code tree to serve (its src folder, put on PYTHONPATH); repeat for each")
    parser.add_argument("--categories", default="mt_bench,translation,qa,math_reasoning")
    parser.add_argument("--per-category", type=int, default=3, help="the first N prompts of each (held out of the priors)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cost-model", type=Path, help="a CostModel JSON both servers price with (default: measured)")
    parser.add_argument("--disturbed", type=float, default=0.15, help="drop a group where others used more cores")
    parser.add_argument("--out", type=Path, default=Path("bench-out/first-token"))
    parser.add_argument("--summary-only", action="store_true", help="summarize --out's records, run nothing")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        trees = dict(tree.split("=", 1) for tree in args.tree)
        trees = {label: str(Path(src).resolve()) for label, src in trees.items()}
        if not trees:
            parser.error("give at least one --tree LABEL=SRC")
        cost_path = args.cost_model or args.out / "cost-model.json"
        if args.cost_model is None:
            measure_cost_model(cost_path)
        write_meta(args, trees, cost_path)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # killed, it still stops its servers
        asyncio.run(run(args, trees, cost_path))
    report = summarize(args.out / "records.jsonl", args.disturbed)
    (args.out / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
