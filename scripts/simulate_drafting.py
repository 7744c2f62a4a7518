"""Replay draft-free drafting policies over recorded greedy outputs, priced with a measured cost model.

Greedy speculative decoding commits exactly the tokens plain decoding commits, so for a
deterministic drafter (prompt lookup, the cross-request cache, `auto` without a draft model) the
whole run — every proposal and how much of it is accepted — follows from the prompt and the
recorded `off` output, without the model. Each round is priced at the cost model's t(1 + proposed);
plain decoding at t(1) per token. The drafters are specdec's own classes, driven as the engine
drives them (begin, propose, observe with the round's seconds).

This is a simulation: it leaves out each round's bookkeeping and the drift of real step times,
and says nothing about the draft model. Speedups claimed anywhere come from `specdec bench`;
this finds what is worth measuring there.

    .venv/bin/python scripts/simulate_drafting.py bench-out/off-ik-15 --cost cost.json \
        --drafters auto,ngram:k2,ngram:k4 [--first 5]
    .venv/bin/python scripts/simulate_drafting.py bench-out/off-ik-15 --fit-priors --skip 5 [--write]

`oracle` is the ceiling of prompt lookup on these costs: it sees the output, so each round it
proposes exactly the part of the longest match's continuation (up to 16 tokens) that will be
accepted, cut where a longer proposal no longer raises tokens per second, and nothing where no
proposal pays. No real policy can beat it with prompt lookup alone. `oracle-suffix` is the same
over every occurrence of the longest match (and the tenant's history's), the suffix sources' ceiling.

--fit-priors prints, from the prompts after the first --skip of each category (the benchmark's
prompts stay out), P(a draft-free source's next token is accepted | its evidence: the match
length's bucket and whether earlier occurrences agree), for the request's own text and for the
earlier fit prompts as the tenant's history: `auto`'s "ngram" and "cache" priors. With --write it
also writes them to specdec/data/drafting_priors.json (or the path given), the file `auto` reads
(drafters/policy/priors.py); the draft model's prior there is kept as it is.
--tenant-history gives each simulated prompt the earlier ones (prompt and `off` output) as its
tenant's history, as `specdec bench --tenant-history` does.
--streams N decodes the prompts in waves of N concurrent streams, as the engine core does: each
round every unfinished stream plans (told how many share the forward), all their rows are priced
as one forward, t(all rows), against plain decoding's t(unfinished streams) a round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np

from specdec.backends.base import Backend
from specdec.backends.cost_model import CostModel
from specdec.backends.sequence import common_prefix_length
from specdec.bench.datasets import load_prompts
from specdec.drafters.auto import AutoDrafter
from specdec.drafters.policy import priors
from specdec.drafters.policy.config import MAX_MATCH
from specdec.drafters.policy.priors import AGREEMENTS, MATCH_BUCKETS, evidence_key
from specdec.drafters.history import TenantHistory as new_history
from specdec.drafters.suffix import SuffixIndex
from specdec.drafters.base import Drafter
from specdec.drafters.ngram import NgramDrafter, NgramIndex
from specdec.types import Proposal, SamplingParams

GREEDY = SamplingParams()
PRIORS_PATH = Path(__file__).resolve().parent.parent / "src" / "specdec" / "data" / priors.PRIORS_FILE


def drafter_factories(cost: CostModel) -> dict[str, Callable[[], tuple[Drafter, int]]]:
    """Name -> (a fresh drafter, its k). k is the most tokens proposed per round."""
    factories = {}
    for k in range(1, 17):
        factories[f"ngram:k{k}"] = lambda k=k: (NgramDrafter(3, 1), k)
        factories[f"auto:k{k}"] = lambda k=k: (AutoDrafter(CostModel(dict(cost.target_seconds))), k)
    factories["auto"] = factories["auto:k3"]
    return factories


agreeing_prefix = common_prefix_length  # how many leading tokens of a proposal equal the actual text's


class OracleLookup(Drafter):
    """Prompt lookup with perfect knowledge of which proposals will hold (see the module doc): of
    its candidates, the one that will hold longest, cut where a longer proposal stops paying."""

    def __init__(self, cost: CostModel, prompt_length: int, output: list[int]):
        self.cost, self.prompt_length, self.output = cost, prompt_length, output
        self.index = NgramIndex(MAX_MATCH)

    def candidates(self, context, k) -> list[tuple[int, ...]]:
        return [self.index.match(context, k)[1]]  # the latest match's continuation

    def propose(self, context, k, sampling, rng) -> Proposal:
        future = self.output[len(context) - self.prompt_length:]
        holds = max((agreeing_prefix(c, future) for c in self.candidates(context, k)), default=0)
        best = max(range(holds + 1), key=lambda n: (n + 1) / self.cost.target(1 + n))
        return Proposal(tuple(future[:best]))


class OracleSuffix(OracleLookup):
    """The ceiling of the suffix sources: every occurrence of the longest match, in the request's
    own text and (with --tenant-history) the tenant's history, is a candidate. No policy choosing
    among the same candidates can beat it."""

    def __init__(self, cost: CostModel, prompt_length: int, output: list[int]):
        super().__init__(cost, prompt_length, output)
        self.index = SuffixIndex(MAX_MATCH)
        self.history = None

    def begin(self, prompt, history=None) -> None:
        self.history = history

    def candidates(self, context, k) -> list[tuple[int, ...]]:
        self.index.track(context)
        candidates = self.index.candidates(context, k)
        if self.history is not None:
            candidates += self.history.candidates(context, k)
        return candidates


def simulate(drafter: Drafter, k: int, prompt: list[int], output: list[int], cost: CostModel,
             history=None) -> dict:
    """One generation's rounds: seconds, rounds, proposed and accepted tokens."""
    return simulate_together([drafter], k, [(prompt, output)], cost, history)


def simulate_together(drafters: list[Drafter], k: int, generations: list[tuple[list[int], list[int]]],
                      cost: CostModel, history=None) -> dict:
    """Generations decoded together as the engine core decodes concurrent streams: each round every
    unfinished stream plans in turn (told how many streams share the forward), all their rows go
    into one forward priced at the cost model's t(all rows), each commits its accepted prefix and one
    token. Plain decoding: one row per unfinished stream a round."""
    contexts = [list(prompt) for prompt, _ in generations]
    positions = [0] * len(generations)
    for drafter, (prompt, _) in zip(drafters, generations):
        drafter.begin(prompt, history)
    rng = np.random.default_rng(0)
    seconds = proposed = accepted = rounds = 0
    while True:
        active = [i for i, (_, output) in enumerate(generations) if positions[i] < len(output)]
        if not active:
            break
        plans = {}
        for i in active:
            output, position = generations[i][1], positions[i]
            budget = min(k, len(output) - position - 1)
            drafters[i].share_round(len(active), tokens_left=len(output) - position)
            plans[i] = drafters[i].propose(contexts[i], budget, GREEDY, rng) if budget > 0 else Proposal(())
        seconds += cost.target(sum(1 + len(p.draft_tokens) for p in plans.values()))
        rounds += 1
        for i, proposal in plans.items():
            output, position = generations[i][1], positions[i]
            matched = agreeing_prefix(proposal.draft_tokens, output[position:])
            drafters[i].observe(proposal, matched, None if len(active) > 1 else cost.target(1 + len(proposal.draft_tokens)))
            proposed += len(proposal.draft_tokens)
            accepted += matched
            step = output[position:position + matched + 1]
            contexts[i].extend(step)
            positions[i] += len(step)
    lengths = [len(output) for _, output in generations]
    plain = sum(cost.target(sum(n > r for n in lengths)) for r in range(max(lengths)))
    return {"seconds": seconds, "rounds": rounds, "proposed": proposed, "accepted": accepted, "plain_seconds": plain}


def print_waves(results: dict[str, list[dict]]) -> None:
    print("| drafter | waves | plain / drafter, median over waves (min-max) | total | acceptance |")
    print("|---|---|---|---|---|")
    for name, waves in results.items():
        ratios = sorted(w["plain_seconds"] / w["seconds"] for w in waves)
        total = sum(w["plain_seconds"] for w in waves) / sum(w["seconds"] for w in waves)
        proposed, accepted = sum(w["proposed"] for w in waves), sum(w["accepted"] for w in waves)
        rate = accepted / proposed if proposed else float("nan")
        print(f"| {name} | {len(waves)} | {statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f}) "
              f"| {total:.3f}x | {rate:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("records", help="a bench output folder whose records hold `off` outputs")
    parser.add_argument("--cost", help="a cost model JSON (CostModel.to_json) or t1_ms:v2,v3,...")
    parser.add_argument("--drafters", default="auto,ngram:k2,ngram:k4,oracle")
    parser.add_argument("--first", type=int, default=None, help="only the first N prompts of each category")
    parser.add_argument("--fit-priors", action="store_true")
    parser.add_argument("--tenant-history", action="store_true",
                        help="drafters see the earlier simulated prompts and outputs as their tenant's history")
    parser.add_argument("--skip", type=int, default=5, help="--fit-priors leaves out the first N per category")
    parser.add_argument("--write", nargs="?", const=str(PRIORS_PATH), default=None, metavar="PATH",
                        help=f"--fit-priors writes the priors `auto` reads (default {PRIORS_PATH})")
    parser.add_argument("--tokenizer-backend", default="ik_llama.cpp")
    parser.add_argument("--streams", type=int, default=1,
                        help="decode the prompts in waves of this many concurrent streams (auto and ngram drafters)")
    args = parser.parse_args()
    generations = load_generations(Path(args.records), args.tokenizer_backend)
    if args.fit_priors:
        fitted = fit_priors(generations, args.skip)
        for source, table in fitted.items():
            print(f"{source}: {{" + ", ".join(f"{key}: {prior}" for key, (_, _, prior) in table.items()) + "}")
            print("  tries, accepted:", {key: (tries, hits) for key, (tries, hits, _) in table.items()})
        if args.write:
            print("wrote", write_priors(fitted, Path(args.write)))
        return 0
    if args.write:
        raise SystemExit("--write goes with --fit-priors")
    if not args.cost:
        raise SystemExit("--cost is needed to simulate drafters")
    cost = load_cost(args.cost)
    factories = drafter_factories(cost)
    if args.streams > 1:
        chosen = [(p, r["output_token_ids"]) for _, rank, p, r in generations if args.first is None or rank < args.first]
        waves = [chosen[i:i + args.streams] for i in range(0, len(chosen), args.streams)]
        results = {}
        for name in args.drafters.split(","):
            results[name] = []
            for wave in waves:
                made = [factories[name]() for _ in wave]
                results[name].append(simulate_together([d for d, _ in made], made[0][1], wave, cost))
        print_waves(results)
        return 0
    by_category: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    history = new_history() if args.tenant_history else None
    for category, rank, prompt_ids, record in generations:
        if args.first is not None and rank >= args.first:
            continue
        for name in args.drafters.split(","):
            if name == "oracle":
                drafter, k = OracleLookup(cost, len(prompt_ids), record["output_token_ids"]), 16
            elif name == "oracle-suffix":
                drafter, k = OracleSuffix(cost, len(prompt_ids), record["output_token_ids"]), 16
            else:
                drafter, k = factories[name]()
            result = simulate(drafter, k, prompt_ids, record["output_token_ids"], cost, history)
            by_category[record["category"]][name].append(result)
        if history is not None:
            history.add(list(prompt_ids) + list(record["output_token_ids"]))
    print_table(by_category, args.drafters.split(","))
    return 0


def load_generations(folder: Path, tokenizer_backend: str) -> list[tuple[str, int, list[int], dict]]:
    """(category, rank in its category, prompt ids, off record) for every recorded `off` output."""
    records = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
    offs = [r for r in records if r["config"] == "off" and r["success"] and r["repeat"] == 0]
    tokenizer = load_tokenizer(tokenizer_backend)
    prompts = {p.id: p for p in load_prompts("spec-bench")}
    order = {p.id: rank for rank, p in enumerate(load_prompts("spec-bench"))}
    generations, ranks = [], defaultdict(int)
    for record in sorted(offs, key=lambda r: order[r["prompt_id"]]):
        prompt_ids = tokenizer.tokenize(tokenizer.apply_chat_template(list(prompts[record["prompt_id"]].messages)),
                                        add_special=False)
        if len(prompt_ids) != record["prompt_tokens"]:
            raise SystemExit(f"prompt {record['prompt_id']} tokenizes to {len(prompt_ids)} tokens, the record "
                             f"says {record['prompt_tokens']}: another tokenizer?")
        generations.append((record["category"], ranks[record["category"]], prompt_ids, record))
        ranks[record["category"]] += 1
    return generations


def fit_priors(generations, skip: int) -> dict:
    """{source: {"bucket,agreement": [tries, accepted, rate]}}: at every output position, the
    continuation each source offers (the request's own context, "ngram"; the earlier fit prompts'
    prompts and outputs, "cache") and whether its next token is the output's, by its evidence."""
    counts: dict[str, dict] = {"ngram": defaultdict(lambda: [0, 0]), "cache": defaultdict(lambda: [0, 0])}
    history = new_history()
    for _, rank, prompt_ids, record in generations:
        if rank < skip:
            continue
        output = record["output_token_ids"]
        index = SuffixIndex(MAX_MATCH)
        context = list(prompt_ids)
        for position in range(len(output) - 1):
            index.track(context)
            for source, continuation in (("ngram", index.continuation(context, 1)),
                                         ("cache", history.continuation(context, 1))):
                if continuation.tokens:
                    cell = counts[source][evidence_key(continuation.evidence[0])]
                    cell[0] += 1
                    cell[1] += continuation.tokens[0] == output[position]
            context.append(output[position])
        history.add(list(prompt_ids) + list(output))
    return {source: smoothed_priors(cells) for source, cells in counts.items()}


def write_priors(fitted: dict, path: Path) -> Path:
    """The fitted tables into the priors file at `path`, the draft model's prior kept from it
    (this replay cannot measure the draft model)."""
    draft = priors.load(path).draft if path.exists() else priors.DRAFT_PRIOR
    tables = {source: {key: prior for key, (_, _, prior) in table.items()} for source, table in fitted.items()}
    return priors.write(path, priors.document(tables["ngram"], tables["cache"], draft))


def smoothed_priors(cells: dict, weight: float = 10.0) -> dict:
    """{(bucket, agreement): [tries, accepted, prior]}, every cell filled: a cell's rate is pulled
    toward its bucket's pooled rate by `weight` observations (sparse cells, e.g. 8 tries, would
    otherwise say 0 or 1); a bucket never seen takes the pooled rate of the nearest shorter one."""
    pooled, table = {}, {}
    for bucket in MATCH_BUCKETS:
        tries = sum(cells[(bucket, a)][0] for a in AGREEMENTS if (bucket, a) in cells)
        hits = sum(cells[(bucket, a)][1] for a in AGREEMENTS if (bucket, a) in cells)
        if tries:
            pooled[bucket] = hits / tries
        elif pooled:
            pooled[bucket] = pooled[max(pooled)]
    for bucket, rate in pooled.items():
        for agreement in AGREEMENTS:
            tries, hits = cells.get((bucket, agreement), (0, 0))
            table[(bucket, agreement)] = [tries, hits, round((hits + weight * rate) / (tries + weight), 2)]
    return table


def print_table(by_category, names) -> None:
    categories = [*by_category, "overall"]
    print("| drafter | " + " | ".join(categories) + " |")
    print("|---|" + "---|" * len(categories))
    for name in names:
        cells = []
        for category in categories:
            results = [r for c in by_category for r in by_category[c][name]] if category == "overall" \
                else by_category[category][name]
            ratios = [r["plain_seconds"] / r["seconds"] for r in results]
            proposed = sum(r["proposed"] for r in results)
            accepted = sum(r["accepted"] for r in results)
            rate = accepted / proposed if proposed else float("nan")
            cells.append(f"{statistics.median(ratios):.3f}x (acc {rate:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def load_cost(text: str) -> CostModel:
    if Path(text).exists():
        return CostModel.from_json(json.loads(Path(text).read_text()))
    t1, _, vs = text.partition(":")
    t1 = float(t1) / 1e3
    seconds = {1: t1, **{n: t1 * float(v) for n, v in enumerate(vs.split(","), start=2)}}
    return CostModel(seconds)


def load_tokenizer(backend: str) -> Backend:
    from specdec.backends.registry import BackendConfig, ModelConfig
    from specdec.models.registry import TARGET, default_path
    from specdec.runtime import load_backend

    return load_backend(ModelConfig(BackendConfig(backend)), default_path(TARGET))


if __name__ == "__main__":
    sys.exit(main())
