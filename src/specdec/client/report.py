"""The batch report: one JSON document (report.json) and its Markdown rendering (report.md).

Read from the whole results file, per id (per line number for an input line with no usable id):
the id's successful line if it has one, else its last failed line. Conventions, written once:
- latency and time to first token are those of the successful attempt, over successful requests;
  percentiles are numpy's (linear interpolation);
- wall time is the time during which at least one request of the batch was in flight (the union of
  the requests' [started_at, finished_at] intervals, failed ones included), so a run that was
  killed and resumed is not charged for the pause between the two;
- throughput = completion tokens (or successful requests) / wall time;
- acceptance rate = accepted / drafted; mean acceptance length = 1 + accepted / draft rounds.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from specdec.client.batch import id_key, read_results, record_key, usage_count
from specdec.client.cost import PriceTable, compute_cost, token_cost
from specdec.client.render import Cells, Spread, fields, markdown_table, spread
from specdec.types import SpecdecError

MAX_REASON_CHARS = 200
DISTRIBUTION = ("count", "mean", "p50", "p95", "p99")  # what report.json keeps of a spread
CELLS = Cells(missing="n/a")


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals.

    Example: (0, 2), (1, 3), (5, 6) → 3 + 1 = 4.
    """
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


@dataclass(frozen=True)
class RunSummary:
    label: str
    results_file: str
    requests: int
    ok: int
    failed: int
    not_run: int  # ids of the input with no line in the results file
    failure_reasons: tuple[tuple[str, int], ...]
    retried: int  # requests that needed more than one attempt (earlier runs' lines included)
    attempts: int  # attempts over all lines of these ids
    duplicate_successes: int  # ids with more than one successful line (0 unless the file was edited)
    unreadable_lines: int
    prompt_tokens: int
    completion_tokens: int
    tokens_by_model: dict  # model -> [prompt_tokens, completion_tokens], successful requests
    latency: Optional[Spread]
    ttft: Optional[Spread]
    wall_seconds: float
    speculative: Optional[dict]
    texts: dict  # id key -> text of the successful line, for comparing runs
    structured: tuple[int, int] = (0, 0)  # (schema-valid, asked for a structure) among successful requests

    @property
    def output_tokens_per_second(self) -> Optional[float]:
        return self.completion_tokens / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def total_tokens_per_second(self) -> Optional[float]:
        return (self.prompt_tokens + self.completion_tokens) / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def requests_per_second(self) -> Optional[float]:
        return self.ok / self.wall_seconds if self.wall_seconds > 0 else None


def summarize(records: Sequence[dict], ids: Optional[Sequence[object]] = None, *, keys: Optional[Sequence[str]] = None,
              label: str = "", results_file: str = "", unreadable_lines: int = 0) -> RunSummary:
    """One run's summary from its result records; `keys` (the input's `BatchItem.key`s, bad lines
    included) or `ids` (the input's ids) limit and complete the set of requests, else every key in
    the records counts."""
    by_id: dict[str, list[dict]] = {}
    for record in records:
        by_id.setdefault(record_key(record), []).append(record)
    if keys is None:
        keys = [id_key(i) for i in ids] if ids is not None else list(by_id)
    final, failures, intervals = {}, Counter(), []
    retried = attempts = duplicates = 0
    for key in keys:
        lines = by_id.get(key, [])
        if not lines:
            continue
        successes = [r for r in lines if r.get("error") is None]
        duplicates += max(0, len(successes) - 1)
        final[key] = successes[0] if successes else lines[-1]
        n_attempts = sum(max(1, len(r.get("attempts") or [])) for r in lines)
        attempts += n_attempts
        retried += n_attempts > 1
        intervals += [(r["started_at"], r["finished_at"]) for r in lines
                      if isinstance(r.get("started_at"), (int, float)) and isinstance(r.get("finished_at"), (int, float))]
        if not successes:
            failures[str(lines[-1].get("error"))[:MAX_REASON_CHARS]] += 1
    ok_records = [r for r in final.values() if r.get("error") is None]
    tokens_by_model: dict[str, list[int]] = {}
    for r in ok_records:
        entry = tokens_by_model.setdefault(str(r.get("model") or "unknown"), [0, 0])
        entry[0] += usage_count(r.get("usage"), "prompt_tokens")
        entry[1] += usage_count(r.get("usage"), "completion_tokens")
    return RunSummary(
        label=label, results_file=results_file, requests=len(keys), ok=len(ok_records),
        failed=len(final) - len(ok_records), not_run=len(keys) - len(final),
        failure_reasons=tuple(failures.most_common()), retried=retried, attempts=attempts,
        duplicate_successes=duplicates, unreadable_lines=unreadable_lines,
        prompt_tokens=sum(v[0] for v in tokens_by_model.values()),
        completion_tokens=sum(v[1] for v in tokens_by_model.values()),
        tokens_by_model=tokens_by_model,
        latency=spread([r["latency_seconds"] for r in ok_records if r.get("latency_seconds") is not None]),
        ttft=spread([r["ttft_seconds"] for r in ok_records if r.get("ttft_seconds") is not None]),
        wall_seconds=busy_seconds(intervals),
        speculative=_speculative(ok_records),
        texts={record_key(r): r.get("text") for r in ok_records},
        structured=(sum(r.get("schema_valid") is True for r in ok_records),
                    sum(r.get("schema_valid") is not None for r in ok_records)),
    )


def summarize_file(path: Union[str, Path], ids: Optional[Sequence[object]] = None, label: str = "", *,
                   keys: Optional[Sequence[str]] = None) -> RunSummary:
    records, unreadable = read_results(path)
    return summarize(records, ids, keys=keys, label=label, results_file=str(path), unreadable_lines=unreadable)


def _speculative(records: Sequence[dict]) -> Optional[dict]:
    blocks = [(r.get("usage") or {}).get("speculative") for r in records]
    blocks = [b for b in blocks if isinstance(b, dict)]
    if not blocks:
        return None
    drafted = sum(usage_count(b, "drafted_tokens") for b in blocks)
    accepted = sum(usage_count(b, "accepted_tokens") for b in blocks)
    rounds = sum(usage_count(b, "draft_rounds") for b in blocks)
    return {
        "requests": len(blocks),
        "methods": sorted({str(b.get("method")) for b in blocks}),
        "draft_rounds": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / rounds if rounds else None,
    }


# -- the JSON document ---------------------------------------------------------------------------------

def cost_section(summary: RunSummary, prices: PriceTable, machine_hour_usd: Optional[float]) -> dict:
    models, total, unpriced = [], 0.0, []
    for model, (prompt, completion) in sorted(summary.tokens_by_model.items()):
        price = prices.lookup(model)
        entry = {"model": model, "prompt_tokens": prompt, "completion_tokens": completion}
        if price is None:
            unpriced.append(model)
            entry["note"] = f"no price configured for model {model!r}"
        else:
            cost = token_cost(price, prompt, completion)
            total += cost.total_usd
            entry.update(input_per_million_usd=price.input_per_million, output_per_million_usd=price.output_per_million,
                         source=price.source, input_usd=cost.input_usd, output_usd=cost.output_usd,
                         total_usd=cost.total_usd)
        models.append(entry)
    token_view = {"models": models, "total_usd": None if unpriced or not models else total}
    if unpriced:
        token_view["note"] = ("no price configured for " + ", ".join(repr(m) for m in unpriced)
                              + " (add it to a --prices file)")
    elif not models:
        token_view["note"] = "no successful request to price"
    if machine_hour_usd is None:
        compute_view = {"note": "no machine-hour price configured (--machine-hour-price)"}
    else:
        compute = compute_cost(machine_hour_usd, summary.wall_seconds, summary.completion_tokens, summary.prompt_tokens)
        compute_view = {"machine_hour_usd": compute.machine_hour_usd, "wall_seconds": compute.wall_seconds,
                        "total_usd": compute.total_usd,
                        "per_million_output_tokens_usd": compute.per_million_output_usd,
                        "per_million_total_tokens_usd": compute.per_million_total_usd}
    return {"token_pricing": token_view, "compute_pricing": compute_view}


def run_section(summary: RunSummary, prices: PriceTable, machine_hour_usd: Optional[float]) -> dict:
    return {
        "label": summary.label,
        "results_file": summary.results_file,
        "requests": {"total": summary.requests, "ok": summary.ok, "failed": summary.failed,
                     "not_run": summary.not_run, "retried": summary.retried, "attempts": summary.attempts,
                     "duplicate_successes": summary.duplicate_successes,
                     "unreadable_lines": summary.unreadable_lines,
                     "failure_reasons": [{"reason": r, "count": n} for r, n in summary.failure_reasons],
                     "schema_valid": summary.structured[0], "structured": summary.structured[1]},
        "tokens": {"prompt": summary.prompt_tokens, "completion": summary.completion_tokens,
                   "total": summary.prompt_tokens + summary.completion_tokens},
        "latency_seconds": None if summary.latency is None else fields(summary.latency, DISTRIBUTION),
        "ttft_seconds": None if summary.ttft is None else fields(summary.ttft, DISTRIBUTION),
        "wall_seconds": summary.wall_seconds,
        "throughput": {"output_tokens_per_second": summary.output_tokens_per_second,
                       "total_tokens_per_second": summary.total_tokens_per_second,
                       "requests_per_second": summary.requests_per_second},
        "speculative": summary.speculative,
        "cost": cost_section(summary, prices, machine_hour_usd),
    }


def _change(new: Optional[float], old: Optional[float]) -> Optional[float]:
    """Relative change new vs old (-0.25 = 25 % lower); None when undefined."""
    if new is None or old is None or old == 0:
        return None
    return new / old - 1.0


def comparison_section(baseline: dict, candidate: dict, base: RunSummary, cand: RunSummary) -> dict:
    def get(section: dict, *path):
        for step in path:
            section = section.get(step) if isinstance(section, dict) else None
        return section

    both = set(base.texts) & set(cand.texts)
    cost_path = ("cost", "compute_pricing", "per_million_output_tokens_usd")
    base_cost, cand_cost = get(baseline, *cost_path), get(candidate, *cost_path)
    speedup = None
    if base.output_tokens_per_second and cand.output_tokens_per_second is not None:
        speedup = cand.output_tokens_per_second / base.output_tokens_per_second
    section = {
        "baseline": baseline["label"], "candidate": candidate["label"],
        "latency_mean_change": _change(get(candidate, "latency_seconds", "mean"), get(baseline, "latency_seconds", "mean")),
        "latency_p50_change": _change(get(candidate, "latency_seconds", "p50"), get(baseline, "latency_seconds", "p50")),
        "ttft_mean_change": _change(get(candidate, "ttft_seconds", "mean"), get(baseline, "ttft_seconds", "mean")),
        "output_tokens_per_second_speedup": speedup,
        "wall_seconds_change": _change(cand.wall_seconds, base.wall_seconds),
        "compute_cost_per_million_output_tokens_saving": (None if _change(cand_cost, base_cost) is None
                                                           else -_change(cand_cost, base_cost)),
        "identical_texts": sum(base.texts[k] == cand.texts[k] for k in both),
        "compared_texts": len(both),
    }
    if base_cost is None or cand_cost is None:
        section["compute_note"] = "no machine-hour price configured (--machine-hour-price): no compute saving computed"
    return section


def build_report(summaries: Sequence[RunSummary], prices: PriceTable, machine_hour_usd: Optional[float], *,
                 endpoint: str = "", model: str = "", settings: Optional[dict] = None) -> dict:
    """The report document; two summaries (baseline first) add a comparison."""
    runs = [run_section(s, prices, machine_hour_usd) for s in summaries]
    return {
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "endpoint": endpoint, "model": model, "settings": settings or {},
        "runs": runs,
        "comparison": comparison_section(runs[0], runs[1], summaries[0], summaries[1]) if len(runs) == 2 else None,
    }


# -- Markdown --------------------------------------------------------------------------------------

def render_markdown(doc: dict) -> str:
    runs = doc["runs"]
    labels = [run["label"] or "run" for run in runs]
    lines = ["# specdec batch report", ""]
    lines.append(f"Endpoint `{doc['endpoint'] or 'n/a'}` · model `{doc['model'] or 'n/a'}` · generated {doc['generated_at']}")
    if doc.get("settings"):
        lines.append("Settings: " + ", ".join(f"{k}={'server default' if v is None else v}"
                                              for k, v in doc["settings"].items()))
    lines.append("")

    def table(title: str, rows: list[tuple[str, list[str]]]) -> None:
        lines.extend([f"## {title}", "", *markdown_table(["", *labels], ([name, *cells] for name, cells in rows)), ""])

    def row(name: str, fn) -> tuple[str, list[str]]:
        return name, [fn(run) for run in runs]

    table("Requests", [
        row("requests", lambda r: str(r["requests"]["total"])),
        row("ok", lambda r: str(r["requests"]["ok"])),
        row("failed", lambda r: str(r["requests"]["failed"])),
        row("not run yet", lambda r: str(r["requests"]["not_run"])),
        row("needed a retry", lambda r: str(r["requests"]["retried"])),
        row("attempts", lambda r: str(r["requests"]["attempts"])),
        row("schema-valid (of those with a response_format)",
            lambda r: f"{r['requests'].get('schema_valid', 0)}/{r['requests'].get('structured', 0)}"),
        row("results file", lambda r: f"`{r['results_file']}`"),
    ])
    for run, label in zip(runs, labels):
        reasons = run["requests"]["failure_reasons"]
        if reasons:
            lines.append(f"Failures ({label}):")
            lines.extend(f"- {entry['count']} × {entry['reason']}" for entry in reasons)
            lines.append("")
        if run["requests"]["unreadable_lines"]:
            lines.extend([f"{run['requests']['unreadable_lines']} unreadable line(s) in {run['results_file']} "
                          "were skipped (a torn last line is cut at the next run).", ""])

    def dist(key: str, stat: str):
        return lambda r: CELLS.number((r[key] or {}).get(stat), ".3f")

    table("Latency (seconds, successful requests)", [
        row(f"latency {stat}", dist("latency_seconds", stat)) for stat in ("mean", "p50", "p95", "p99")
    ] + [row(f"time to first token {stat}", dist("ttft_seconds", stat)) for stat in ("mean", "p50", "p95", "p99")])
    table("Tokens and throughput", [
        row("prompt tokens", lambda r: str(r["tokens"]["prompt"])),
        row("completion tokens", lambda r: str(r["tokens"]["completion"])),
        row("wall time (s)", lambda r: CELLS.number(r["wall_seconds"], ".2f")),
        row("output tokens/s", lambda r: CELLS.number(r["throughput"]["output_tokens_per_second"], ".2f")),
        row("total tokens/s", lambda r: CELLS.number(r["throughput"]["total_tokens_per_second"], ".2f")),
        row("requests/s", lambda r: CELLS.number(r["throughput"]["requests_per_second"], ".3f")),
    ])
    if any(run["speculative"] for run in runs):
        table("Speculation (as reported by the server)", [
            row("method", lambda r: ", ".join(r["speculative"]["methods"]) if r["speculative"] else "none reported"),
            row("acceptance rate", lambda r: CELLS.number((r["speculative"] or {}).get("acceptance_rate"), ".3f")),
            row("mean acceptance length", lambda r: CELLS.number((r["speculative"] or {}).get("mean_acceptance_length"), ".2f")),
        ])

    def token_cost_cell(run: dict) -> str:
        view = run["cost"]["token_pricing"]
        return CELLS.usd(view["total_usd"]) if view["total_usd"] is not None else view.get("note", "n/a")

    def compute_cell(key: str):
        return lambda r: CELLS.usd(r["cost"]["compute_pricing"][key]) if key in r["cost"]["compute_pricing"] \
            else r["cost"]["compute_pricing"]["note"]

    table("Cost", [
        row("token pricing, total", token_cost_cell),
        row("compute pricing, total", compute_cell("total_usd")),
        row("compute per million output tokens", compute_cell("per_million_output_tokens_usd")),
        row("compute per million tokens (prompt included)", compute_cell("per_million_total_tokens_usd")),
    ])
    priced = {(m["model"], m.get("input_per_million_usd"), m.get("output_per_million_usd"), m.get("source"))
              for run in runs for m in run["cost"]["token_pricing"]["models"] if "total_usd" in m}
    for model, inp, out, source in sorted(priced, key=str):
        lines.append(f"Token prices for `{model}`: ${inp}/M input, ${out}/M output" + (f" ({source})." if source else "."))
    machine = {r["cost"]["compute_pricing"].get("machine_hour_usd") for r in runs} - {None}
    if machine:
        lines.append(f"Compute pricing: ${machine.pop()}/machine-hour × wall time (time with a request in flight).")
    lines.append("")

    comparison = doc.get("comparison")
    if comparison:
        c = comparison
        saving = c["compute_cost_per_million_output_tokens_saving"]
        saving_cell = CELLS.change(saving) if saving is not None else c.get("compute_note", "n/a")
        lines.extend([f"## {c['candidate']} vs {c['baseline']}", "",
                      *markdown_table(["", f"{c['candidate']} vs {c['baseline']}"], [
                          ["mean latency", CELLS.change(c['latency_mean_change'])],
                          ["p50 latency", CELLS.change(c['latency_p50_change'])],
                          ["mean time to first token", CELLS.change(c['ttft_mean_change'])],
                          ["output tokens/s", f"{CELLS.number(c['output_tokens_per_second_speedup'], '.2f')}×"],
                          ["wall time", CELLS.change(c['wall_seconds_change'])],
                          ["compute cost per million output tokens, saving", saving_cell],
                          ["identical texts", f"{c['identical_texts']} of {c['compared_texts']}"],
                      ]),
                      ""])
        lines.append("Token pricing does not depend on speed: the same tokens cost the same in both runs.")
        lines.append("")
    return "\n".join(lines)


def json_path_for(report_path: Union[str, Path]) -> Path:
    report_path = Path(report_path)
    json_path = report_path.with_suffix(".json")
    if json_path == report_path:
        raise SpecdecError(f"--report {report_path}: give the Markdown path (report.md); report.json goes beside it.")
    return json_path


def write_report(report_path: Union[str, Path], doc: dict) -> tuple[Path, Path]:
    report_path = Path(report_path)
    json_path = json_path_for(report_path)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    # A lone surrogate (from a server's model name or error message) is written as its \udXXX escape.
    report_path.write_text(render_markdown(doc), encoding="utf-8", errors="backslashreplace")
    json_path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return report_path, json_path


def summary_text(doc: dict) -> str:
    """A few lines for the terminal."""
    out = []
    for run in doc["runs"]:
        req, lat, thr = run["requests"], run["latency_seconds"] or {}, run["throughput"]
        prefix = f"[{run['label']}] " if run["label"] else ""
        out.append(f"{prefix}{req['ok']}/{req['total']} ok, {req['failed']} failed, {req['not_run']} not run; "
                   f"latency mean {CELLS.number(lat.get('mean'), '.3f')}s p95 {CELLS.number(lat.get('p95'), '.3f')}s; "
                   f"{CELLS.number(thr['output_tokens_per_second'], '.2f')} output tok/s")
    c = doc.get("comparison")
    if c:
        out.append(f"{c['candidate']} vs {c['baseline']}: {CELLS.number(c['output_tokens_per_second_speedup'], '.2f')}× output tok/s, "
                   f"mean latency {CELLS.change(c['latency_mean_change'])}, identical texts {c['identical_texts']}/{c['compared_texts']}")
    return "\n".join(out)
