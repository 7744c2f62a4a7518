"""The fitted priors of `auto`, read once from specdec/data/drafting_priors.json.

The file holds P(a draft-free source's next token is accepted | its evidence) for the request's own
text ("ngram") and the tenant's earlier requests ("cache"), and the draft model's per-token
acceptance ("draft"). `scripts/simulate_drafting.py RECORDS --fit-priors --write` refits the two
tables from a bench run's `off` outputs and rewrites the file (`document`, `write`); the figures
behind them are in docs/notebook.md ("Drafting for cheap verification").
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Mapping, Optional, Union

from specdec.drafters.suffix import Evidence

PRIORS_FILE = "drafting_priors.json"
# The evidence a prior is keyed by: the match length's bucket (m = 1, 2, 3, 4, 5-6, 7-9, 10-13,
# 14+, each named by its longest m) and whether earlier occurrences agree (Evidence.agreement).
MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 13, 10**9)
AGREEMENTS = ("single", "unanimous", "majority", "split")
COMMENT = (
    "Priors of the adaptive method `auto` (src/specdec/drafters/policy/priors.py). 'ngram' and 'cache': "
    "P(a draft-free source's next token is accepted | its evidence), per match-length bucket (keyed by the "
    "bucket's longest match; 1000000000 is the open bucket 14+) and per agreement of the earlier occurrences, "
    "in the order of 'agreements'; fit on Spec-Bench prompts 6-15 of each category (greedy outputs of the "
    "default pair on ik_llama.cpp, 128 tokens) and written by `scripts/simulate_drafting.py RECORDS "
    "--fit-priors --write`. 'draft': the draft model's per-token acceptance, from the default pair's mean "
    "acceptance length on Spec-Bench (docs/notebook.md); the fit keeps it as it is."
)

EvidenceKey = tuple[int, str]  # (match bucket, agreement)


@dataclass(frozen=True)
class Priors:
    ngram: dict[EvidenceKey, float]
    cache: dict[EvidenceKey, float]
    draft: float


def match_bucket(match_length: int) -> int:
    """The MATCH_BUCKETS bound whose bucket holds this match length."""
    return next(bound for bound in MATCH_BUCKETS if max(1, match_length) <= bound)


def evidence_key(evidence: Evidence) -> EvidenceKey:
    return match_bucket(evidence.match_length), evidence.agreement


def by_evidence(rows: Mapping[int, tuple[float, ...]]) -> dict[EvidenceKey, float]:
    """{bucket: (rate if single, unanimous, majority, split)} -> {(bucket, agreement): rate}."""
    return {(bucket, agreement): rate for bucket, rates in rows.items() for agreement, rate in zip(AGREEMENTS, rates)}


def parse(document: dict) -> Priors:
    """The priors in a document as `document` writes it; a table keyed differently is an error."""
    if tuple(document["match_buckets"]) != MATCH_BUCKETS or tuple(document["agreements"]) != AGREEMENTS:
        raise ValueError(f"{PRIORS_FILE}: buckets or agreements differ from the code's (priors.py)")
    tables = {}
    for source in ("ngram", "cache"):
        rows = {int(bucket): tuple(float(rate) for rate in rates) for bucket, rates in document[source].items()}
        if any(bucket not in MATCH_BUCKETS or len(rates) != len(AGREEMENTS) for bucket, rates in rows.items()):
            raise ValueError(f"{PRIORS_FILE}: a {source} row is not one rate per agreement of a known bucket")
        tables[source] = by_evidence(rows)
    return Priors(tables["ngram"], tables["cache"], float(document["draft"]))


def load(path: Optional[Union[str, Path]] = None) -> Priors:
    """The priors in `path`, by default the packaged file."""
    if path is None:
        text = resources.files("specdec").joinpath("data").joinpath(PRIORS_FILE).read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return parse(json.loads(text))


def document(ngram: Mapping[EvidenceKey, float], cache: Mapping[EvidenceKey, float], draft: float) -> dict:
    """The file's content for these tables ({(bucket, agreement): rate}, every agreement of a
    bucket present) and draft prior."""
    def rows(table):
        buckets = sorted({bucket for bucket, _ in table})
        return {str(bucket): [table[(bucket, agreement)] for agreement in AGREEMENTS] for bucket in buckets}

    return {"_comment": COMMENT, "match_buckets": list(MATCH_BUCKETS), "agreements": list(AGREEMENTS),
            "ngram": rows(ngram), "cache": rows(cache), "draft": draft}


def dumps(content: dict) -> str:
    """JSON with one table row per line, so that a refit reads as a diff of rows."""
    lines = ["{"]
    for i, (key, value) in enumerate(content.items()):
        comma = "," if i < len(content) - 1 else ""
        if isinstance(value, dict):
            rows = [f"    {json.dumps(bucket)}: {json.dumps(rates)}" for bucket, rates in value.items()]
            lines += [f"  {json.dumps(key)}: {{", ",\n".join(rows), f"  }}{comma}"]
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(path: Union[str, Path], content: dict) -> Path:
    parse(content)  # what is written must load
    path = Path(path)
    path.write_text(dumps(content), encoding="utf-8")
    return path


PRIORS = load()
NGRAM_PRIORS = PRIORS.ngram
CACHE_PRIORS = PRIORS.cache
DRAFT_PRIOR = PRIORS.draft
