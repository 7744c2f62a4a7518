"""From records to report.md, report.json and PNG charts, all at the top level of the output folder.

Definitions (written once, repeated in the report):
- decode tokens/s: the engine's `tokens_per_second` (generated tokens / (total - prompt time)).
- speedup (mean tok/s): mean tokens/s of a configuration / mean tokens/s of `off`, over the
  (prompt, repeat) pairs where both succeeded: the ratio of means of Spec-Bench's
  evaluation/speed.py (which divides by wall time: that is our e2e speedup).
- speedup (median per-prompt): the median over prompts of (mean tokens/s of the configuration on
  that prompt / mean tokens/s of `off` on it), repeats averaged first.
- e2e speedup: the same ratio of means, on generated tokens / wall time, where wall time includes
  prompt processing.
- mean acceptance length: 1 + accepted / draft rounds, pooled over the records (counts the
  target's own token of each round); acceptance rate: accepted / drafted, pooled.
- identical to off: greedy outputs equal to `off`'s token for token, out of those compared.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from specdec.client.render import Cells, fields, markdown_table, spread

BASELINE = "off"
OVERALL = "overall"
OWN_SOURCE = "specdec"
SPEEDUP_CHART = "speedup_by_category.png"
ACCEPTANCE_CHART = "acceptance_length_histogram.png"
QUARTILES = ("median", "p25", "p75", "min", "max", "mean")
CELLS = Cells()

DEFINITIONS = {
    "decode_tps": "the engine's tokens_per_second: generated tokens / (total time - prompt processing time)",
    "speedup_mean": "mean decode tok/s of the configuration / mean decode tok/s of off, over (prompt, repeat) "
                    "pairs where both succeeded (the ratio of means of Spec-Bench's evaluation/speed.py)",
    "speedup_median": "median over prompts of (config mean tok/s / off mean tok/s on that prompt), repeats averaged first",
    "wall_seconds": "wall time of the whole generation, prompt processing included",
    "e2e_speedup": "ratio of mean (generated tokens / wall time) vs off, prompt processing included "
                   "(exactly Spec-Bench's speed.py, which times the whole generation)",
    "mean_acceptance_length": "1 + accepted / draft rounds, pooled (counts the target's own token per round)",
    "acceptance_rate": "accepted / drafted, pooled",
    "identical": "greedy outputs identical to off token for token / outputs compared",
    "target_logit_margin": "target's top-1 minus top-2 logit at the first differing position of the off output",
}


# -- arithmetic --------------------------------------------------------------------------------
def quartiles(values: Sequence[float]) -> dict:
    """What report.json keeps of a spread: median, quartiles (linear interpolation), min, max, mean."""
    return fields(spread(values), QUARTILES)


def _stat(record: dict, key: str):
    stats = record.get("stats") or {}
    return stats.get(key)


def _e2e_tps(record: dict) -> Optional[float]:
    wall = record.get("wall_seconds")
    generated = _stat(record, "generated_tokens")
    return generated / wall if wall and generated is not None else None


def paired_values(records: Iterable[dict], baseline: Iterable[dict], value) -> list[tuple[str, float, float]]:
    """(prompt id, config value, off value) for each (prompt, repeat) where both have a value."""
    base = {}
    for record in baseline:
        v = value(record) if record.get("success") else None
        if v is not None:
            base[(str(record["prompt_id"]), int(record["repeat"]))] = v
    pairs = []
    for record in records:
        v = value(record) if record.get("success") else None
        key = (str(record["prompt_id"]), int(record["repeat"]))
        if v is not None and key in base:
            pairs.append((key[0], v, base[key]))
    return pairs


def speedup_of_means(pairs: Sequence[tuple[str, float, float]]) -> Optional[float]:
    """mean(config) / mean(off) over paired records (Spec-Bench's ratio of mean tokens/s)."""
    if not pairs:
        return None
    base = np.mean([b for _, _, b in pairs])
    return float(np.mean([v for _, v, _ in pairs]) / base) if base > 0 else None


def median_of_ratios(pairs: Sequence[tuple[str, float, float]]) -> Optional[float]:
    """Median over prompts of mean(config) / mean(off), repeats averaged per prompt first."""
    per_prompt: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for prompt_id, v, b in pairs:
        per_prompt[prompt_id][0].append(v)
        per_prompt[prompt_id][1].append(b)
    ratios = [np.mean(v) / np.mean(b) for v, b in per_prompt.values() if np.mean(b) > 0]
    return float(np.median(ratios)) if ratios else None


def acceptance_length_counts(stats: dict) -> list[int]:
    """Draft rounds by acceptance length: entry j counts rounds with j accepted (length j + 1).

    accepted_per_position[i] counts rounds that accepted position i, hence accepted > i, because
    acceptance is a prefix. Example: 10 rounds, accepted_per_position [6, 2] -> [4, 4, 2].
    """
    rounds = stats.get("draft_rounds") or 0
    at_least = [rounds, *(stats.get("accepted_per_position") or [])]
    return [at_least[j] - (at_least[j + 1] if j + 1 < len(at_least) else 0) for j in range(len(at_least))] if rounds else []


def summarize_config(records: Sequence[dict], baseline: Sequence[dict]) -> dict:
    ok = [r for r in records if r.get("success")]
    tps = [v for v in (_stat(r, "tokens_per_second") for r in ok) if v is not None]
    walls = [r["wall_seconds"] for r in ok if r.get("wall_seconds") is not None]
    decode_pairs = paired_values(records, baseline, lambda r: _stat(r, "tokens_per_second"))
    e2e_pairs = paired_values(records, baseline, _e2e_tps)
    drafted = sum(_stat(r, "drafted_tokens") or 0 for r in ok)
    accepted = sum(_stat(r, "accepted_tokens") or 0 for r in ok)
    rounds = sum(_stat(r, "draft_rounds") or 0 for r in ok)
    draft_s = sum(_stat(r, "draft_seconds") or 0.0 for r in ok)
    verify_s = sum(_stat(r, "verify_seconds") or 0.0 for r in ok)
    compared = [r for r in ok if r.get("matches_off") is not None]
    choices: dict[str, int] = defaultdict(int)
    sources: dict[str, dict[str, int]] = defaultdict(lambda: {"rounds": 0, "drafted": 0, "accepted": 0})
    for record in ok:
        for choice, count in (_stat(record, "choices") or {}).items():
            choices[choice] += count
        for source, totals in (_stat(record, "sources") or {}).items():  # absent in records before 2026-12-01
            for key in ("rounds", "drafted", "accepted"):
                sources[source][key] += totals.get(key, 0)
    ttft = [v for v in (_stat(r, "ttft_seconds") for r in ok) if v is not None]
    return {
        "records": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "decode_tps": quartiles(tps),
        "speedup_mean": speedup_of_means(decode_pairs),
        "speedup_median": median_of_ratios(decode_pairs),
        "paired": len(decode_pairs),
        "wall_seconds": quartiles(walls),
        "e2e_speedup": speedup_of_means(e2e_pairs),
        "ttft_seconds_median": quartiles(ttft)["median"],
        "generated_tokens": sum(_stat(r, "generated_tokens") or 0 for r in ok),
        "draft_rounds": rounds,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / rounds if rounds else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_time_share": draft_s / (draft_s + verify_s) if draft_s + verify_s > 0 else None,
        "compared_with_off": len(compared),
        "identical_to_off": sum(1 for r in compared if r["matches_off"]),
        "choices": dict(sorted(choices.items(), key=lambda item: -item[1])),
        "sources": {source: {**totals, "mean_acceptance_length": 1 + totals["accepted"] / totals["rounds"],
                             "acceptance_rate": totals["accepted"] / totals["drafted"]}
                    for source, totals in sorted(sources.items()) if totals["rounds"]},
    }


def _ordered(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def summarize(records: Sequence[dict], baseline_label: str = BASELINE) -> dict:
    """{category or "overall": {config: summary}} for one source's records."""
    categories = _ordered(r["category"] for r in records)
    configs = _ordered(r["config"] for r in records)
    result = {}
    for category in [*categories, OVERALL]:
        subset = records if category == OVERALL else [r for r in records if r["category"] == category]
        by_config = defaultdict(list)
        for record in subset:
            by_config[record["config"]].append(record)
        baseline = by_config.get(baseline_label, [])
        result[category] = {c: summarize_config(by_config[c], baseline) for c in configs if by_config.get(c)}
    return result


def differences(records: Sequence[dict]) -> list[dict]:
    keys = ("prompt_id", "category", "config", "repeat", "first_diff_position", "off_token", "token",
            "target_logit_margin", "target_argmax_at_diff", "margin_error")
    return [{k: r.get(k) for k in keys} for r in records if r.get("matches_off") is False]


def failures(records: Sequence[dict]) -> list[dict]:
    return [{k: r.get(k) for k in ("source", "prompt_id", "category", "config", "repeat", "error")}
            for r in records if not r.get("success")]


def acceptance_histograms(records: Sequence[dict]) -> dict[str, list[int]]:
    totals: dict[str, list[int]] = {}
    for record in records:
        if not record.get("success") or record.get("config") == BASELINE:
            continue
        counts = acceptance_length_counts(record.get("stats") or {})
        total = totals.setdefault(record["config"], [])
        total.extend([0] * (len(counts) - len(total)))
        for j, n in enumerate(counts):
            total[j] += n
    return totals


# -- the report ---------------------------------------------------------------------------------
def build_report(records: Sequence[dict], meta: dict, peer_status: dict[str, str], out_dir: Path) -> dict:
    """Write report.json, report.md and the charts into out_dir; returns the report dict."""
    out_dir = Path(out_dir)
    own = [r for r in records if r.get("source", OWN_SOURCE) == OWN_SOURCE]
    report = {
        "meta": meta,
        "definitions": DEFINITIONS,
        "categories": _ordered(r["category"] for r in own),
        "configs": _ordered(r["config"] for r in own),
        "summary": summarize(own),
        "acceptance_length_histogram": acceptance_histograms(own),
        "differences": differences(own),
        "failures": failures(records),
        "peers": peer_summaries(records, own, peer_status),
        "charts": [SPEEDUP_CHART, ACCEPTANCE_CHART],
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    write_charts(report, out_dir)
    (out_dir / "report.md").write_text(render_markdown(report), encoding="utf-8")
    return report


def peer_summaries(records: Sequence[dict], own: Sequence[dict], peer_status: dict[str, str]) -> dict:
    """Per peer: its status line, and per configuration its numbers vs its own no-draft run and vs our off."""
    own_off = [r for r in own if r["config"] == BASELINE]
    peers = {}
    for peer, status in peer_status.items():
        mine = [r for r in records if r.get("source") == peer]
        configs = _ordered(r["config"] for r in mine)
        baseline_label = f"{peer}:{BASELINE}"
        baseline = [r for r in mine if r["config"] == baseline_label]
        rows = {}
        for config in configs:
            subset = [r for r in mine if r["config"] == config]
            row = summarize_config(subset, baseline)
            pairs = paired_values(subset, own_off, lambda r: _stat(r, "tokens_per_second"))
            row["speedup_vs_specdec_off"] = speedup_of_means(pairs)
            same_text = paired_values(subset, baseline, lambda r: r.get("text"))
            row["compared_with_own_off"] = len(same_text) if config != baseline_label else 0
            row["identical_text_to_own_off"] = sum(1 for _, a, b in same_text if a == b) if config != baseline_label else 0
            rows[config] = row
        peers[peer] = {"status": status, "configs": rows}
    return peers


def _iqr(tps: dict) -> str:
    return CELLS.span(tps["p25"], tps["p75"])


def _table(summary: dict) -> list[str]:
    header = ["config", "n", "decode tok/s median", "IQR", "min–max", "speedup (mean tok/s)",
              "speedup (median per-prompt)", "wall s (mean)", "e2e speedup", "mean acc. length", "acc. rate",
              "identical to off"]
    rows = []
    for config, row in summary.items():
        tps = row["decode_tps"]
        n = f"{row['succeeded']}" + (f" ({row['failed']} failed)" if row["failed"] else "")
        identical = "—" if config == BASELINE or not row["compared_with_off"] else f"{row['identical_to_off']}/{row['compared_with_off']}"
        rows.append([config, n, CELLS.number(tps["median"]), _iqr(tps), CELLS.span(tps["min"], tps["max"]),
                     CELLS.number(row["speedup_mean"], ".2f", "×"), CELLS.number(row["speedup_median"], ".2f", "×"),
                     CELLS.number(row["wall_seconds"]["mean"]), CELLS.number(row["e2e_speedup"], ".2f", "×"),
                     CELLS.number(row["mean_acceptance_length"]), CELLS.number(row["acceptance_rate"]), identical])
    return markdown_table(header, rows)


def _decisions(report: dict) -> list[str]:
    """Per category, what the adaptive configurations proposed, as shares of their rounds."""
    adaptive = [c for c in report["configs"] if c.split(":")[0] == "auto"]
    if not adaptive:
        return ["No adaptive configuration in this run."]
    rows = []
    for config in adaptive:
        for category in [*report["categories"], OVERALL]:
            summary = report["summary"][category].get(config, {})
            choices = summary.get("choices") or {}
            total = sum(choices.values())
            shares = ", ".join(f"{choice} {count / total:.1%}" for choice, count in choices.items()) if total else "—"
            per_source = "; ".join(f"{source} {s['rounds']}, {s['mean_acceptance_length']:.2f}, {s['acceptance_rate']:.2f}"
                                   for source, s in (summary.get("sources") or {}).items()) or "—"
            rows.append([config, category, total, shares, per_source])
    return markdown_table(["config", "category", "rounds", "choices (share of rounds)",
                           "per source: rounds, mean acc. length, acc. rate"], rows)


def render_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = ["# specdec benchmark report", ""]
    for key in ("date", "command", "dataset", "prompts", "categories", "max_tokens", "temperature", "repeats",
                "warmup", "configs", "machine", "models"):
        if key in meta:
            value = meta[key]
            if isinstance(value, (list, dict)):
                value = json.dumps(value, ensure_ascii=False)
            lines.append(f"- {key}: {value}")
    lines += ["", "## Overall", ""]
    lines += _table(report["summary"].get(OVERALL, {}))
    for category in report["categories"]:
        lines += ["", f"## {category}", ""]
        lines += _table(report["summary"][category])
    lines += ["", "## Decisions (rounds per proposal: source and length, or none)", ""]
    lines += _decisions(report)
    peer_rows = []
    for peer, info in report["peers"].items():
        if not info["configs"]:
            peer_rows.append([peer, "—", "—", info["status"], *["—"] * 6])
        for config, row in info["configs"].items():
            tps = row["decode_tps"]
            n = f"{row['succeeded']}" + (f" ({row['failed']} failed)" if row["failed"] else "")
            # Its own no-draft run is the reference, compared with nothing: "—", not "0/—".
            identical = (f"{row['identical_text_to_own_off']}/{row['compared_with_own_off']}"
                         if row["compared_with_own_off"] else "—")
            peer_rows.append([peer, config, n, CELLS.number(tps["median"]), _iqr(tps),
                              CELLS.number(row["speedup_mean"], ".2f", "×"), CELLS.number(row["speedup_median"], ".2f", "×"),
                              CELLS.number(row["speedup_vs_specdec_off"], ".2f", "×"), CELLS.number(row["acceptance_rate"]), identical])
    lines += ["", "## Peers (same prompts, same run)", ""]
    lines += markdown_table(["peer", "config", "n", "decode tok/s median", "IQR",
                             "speedup vs its no-draft run (mean tok/s)", "(median per-prompt)", "speedup vs specdec off",
                             "acc. rate", "text identical to its no-draft run"], peer_rows)
    lines += ["", "## Greedy output equality vs off", ""]
    diffs = report["differences"]
    if meta.get("temperature", 0) > 0:
        lines.append("Not checked: the run sampled (temperature > 0).")
    elif not diffs:
        lines.append("Every successful output is identical to off, token for token.")
    else:
        lines += markdown_table(["prompt", "category", "config", "repeat", "first differing position", "off token",
                                 "config token", "target logit margin"],
                                [[d["prompt_id"], d["category"], d["config"], d["repeat"], d["first_diff_position"],
                                  CELLS.number(d["off_token"], "d"), CELLS.number(d["token"], "d"), CELLS.number(d["target_logit_margin"], ".4f")]
                                 for d in diffs])
    if report["failures"]:
        lines += ["", "## Failures", ""]
        lines += markdown_table(["source", "prompt", "config", "repeat", "error"],
                                [[f["source"] or OWN_SOURCE, f["prompt_id"], f["config"], f["repeat"],
                                  str(f["error"]).replace("|", "\\|").replace("\n", " ")] for f in report["failures"]])
    lines += ["", "## Charts", "", f"![speedup per category]({SPEEDUP_CHART})", "",
              f"![acceptance length histogram]({ACCEPTANCE_CHART})", "", "## Columns", ""]
    lines += [f"- {key}: {text}" for key, text in DEFINITIONS.items()]
    return "\n".join(lines) + "\n"


# -- charts -------------------------------------------------------------------------------------
def write_charts(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in report["configs"] if c != BASELINE]
    groups = [*report["categories"], OVERALL]
    width = 0.8 / max(len(configs), 1)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) + 2), 4.5))
    x = np.arange(len(groups))
    for i, config in enumerate(configs):
        heights = [report["summary"][g].get(config, {}).get("speedup_mean") or 0.0 for g in groups]
        ax.bar(x + (i - (len(configs) - 1) / 2) * width, heights, width, label=config)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, groups, rotation=20)
    ax.set_ylabel("speedup vs off (ratio of mean decode tok/s)")
    ax.set_title("Speedup per category")
    _save_chart(fig, ax, bool(configs), "no speculative configuration measured", out_dir / SPEEDUP_CHART)

    histograms = report["acceptance_length_histogram"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    longest = max((len(h) for h in histograms.values()), default=0)
    lengths = np.arange(1, longest + 1)
    hist_configs = [c for c in configs if sum(histograms.get(c, [])) > 0]
    hist_width = 0.8 / max(len(hist_configs), 1)
    for i, config in enumerate(hist_configs):
        counts = np.zeros(longest)
        counts[:len(histograms[config])] = histograms[config]
        ax.bar(lengths + (i - (len(hist_configs) - 1) / 2) * hist_width, counts / counts.sum(), hist_width, label=config)
    ax.set_xlabel("acceptance length (accepted drafts + 1)")
    ax.set_ylabel("fraction of draft rounds")
    ax.set_title("Acceptance length per draft round")
    if hist_configs:
        ax.set_xticks(lengths)
    _save_chart(fig, ax, bool(hist_configs), "no draft rounds recorded", out_dir / ACCEPTANCE_CHART)


def _save_chart(fig, ax, has_data: bool, empty_message: str, path: Path) -> None:
    """Legend when there is data, a centred note when there is none; then write the PNG."""
    import matplotlib.pyplot as plt

    if has_data:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, empty_message, ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
