"""The speculative decoding loop: draft -> verify in one target forward -> commit -> roll back.

Invariant between rounds: the target's cache holds every committed token but the last one
("pending"); a round evaluates [pending, d1..dk] in one forward, which yields the target's
distribution at each draft position plus one. Plain decoding is the same loop with k = 0.
"""
from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Callable, Generator, Optional

import numpy as np

from specdec.backends.sequence import CachedSequence
from specdec.drafters.base import DraftForward, Drafter, DraftReply, run_alone
from specdec.drafters.history import TenantHistory
from specdec.drafters.registry import OFF
from specdec.engine.stats import GenerationStats
from specdec.engine.stopping import TextAssembler
from specdec.grammar.constraint import Constraint
from specdec.sampling.logprobs import token_logprobs
from specdec.sampling.probs import biased_logits, one_hot, position_uniform, sample_with, token_distribution
from specdec.sampling.verify import verify, verify_deterministic
from specdec.types import GenerationRequest, Proposal, RoundOutcome, SpecdecError, StreamEvent, TokenLogprob


TARGET_SOURCE = "target"  # a token the target chose itself (every round's last)
GRAMMAR_SOURCE = "grammar"  # a token the grammar forced (proposed without a drafter)


class Generation:
    """One request's state. The engine core (core.py) drives it: `start()` once its prompt is
    processed, then per round `plan()`, the target's forward over the planned tokens, `commit()`."""

    def __init__(
        self,
        request: GenerationRequest,
        target: CachedSequence,
        drafter: Drafter,
        *,
        clock: Callable[[], float] = time.perf_counter,
        history: Optional[TenantHistory] = None,
        constraint: Optional[Constraint] = None,
    ):
        prompt = request.prompt_token_ids
        if not prompt:
            raise SpecdecError("the prompt is empty.")
        if len(prompt) >= target.backend.n_ctx:
            raise SpecdecError(f"the prompt has {len(prompt)} tokens but the context holds only {target.backend.n_ctx}.")
        request.sampling.check_vocabulary(target.backend.vocab_size)
        self.request = request
        self.target = target
        self.drafter = drafter
        self.clock = clock
        self.history = history  # the tenant's cross-request history: drafts from it, learns our text
        # The request's grammar: every verified row is masked by the state its proposal reached.
        self.constraint = constraint
        # Sampling noise: keyed by (seed, position) for the target's own tokens, so off, n-gram
        # drafting and auto's n-gram rounds sample the same text for one seed; a sequence for the
        # draft model's proposals and their acceptance (Leviathan's rule with its q).
        self.seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(64)
        self.rng = np.random.default_rng([self.seed, 1 << 64])  # a stream no position key collides with
        # The request's sampling less its logit_bias: the target's rows get the bias once, in
        # _target_row, before the grammar's mask and every transform; the drafters get none (their
        # proposals are verified against the biased target, so it cannot change the output).
        sampling = request.sampling
        self._shaping = dataclasses.replace(sampling, logit_bias=()) if sampling.logit_bias else sampling
        self.context: list[int] = list(request.prompt_token_ids)  # prompt + generated; last = pending
        self.token_ids: list[int] = []
        self.assembler = TextAssembler(request.stop)
        self.finish_reason: Optional[str] = None
        k = request.spec.num_draft_tokens if request.spec.method != OFF.name else 0
        self.stats = GenerationStats(method=request.spec.method, num_draft_tokens=k)
        self._k = k
        self._proposal = Proposal(())  # the round planned and not yet committed
        self._drafted = 0  # of the proposal's tokens, the drafter's (the rest were forced by the grammar)
        self._sources: list[str] = []  # of the tokens the next event carries
        self._logprobs: Optional[list[TokenLogprob]] = None  # of the tokens the next event carries, when asked
        self._started_at = 0.0
        self.cached_prompt_tokens = 0  # of the prompt, found in the slot's cache when it was admitted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # -- stages ------------------------------------------------------------------------------
    def start(self, started_at: Optional[float] = None) -> None:
        """Begin generating once the prompt is processed: the core processed it in chunks from
        `started_at` on (this processes whatever it left, normally nothing)."""
        prompt = self.request.prompt_token_ids
        self._started_at = self.clock() if started_at is None else started_at
        self.target.prefill(prompt[:-1])
        self.drafter.begin(prompt, self.history)
        self.stats.prompt_tokens = len(prompt)
        self.stats.cached_prompt_tokens = self.cached_prompt_tokens
        self.stats.prompt_seconds = self.clock() - self._started_at
        if self.request.max_tokens is not None and self.request.max_tokens <= 0:
            self._finish("length")

    def plan(self, streams: int = 1) -> list[int]:
        """Ask the drafter for a proposal; returns the tokens the target must evaluate.
        `streams`: how many generations' rows the verification forward holds, this one's included."""
        return run_alone(self.plan_steps(streams), self.clock)

    def plan_steps(self, streams: int = 1, draft_sharers: int = 1,
                   rows_before: int = 0) -> Generator[DraftForward, DraftReply, list[int]]:
        """plan() with the proposal's draft-model forwards yielded (drafters/base.py DraftSteps), for
        the engine core to run with other streams'. `draft_sharers`: the streams expected to draft
        with the model this round, this one included (their forwards are shared); `rows_before`:
        the extra rows the streams planned before this one put in the verification forward."""
        room = self.target.backend.n_ctx - len(self.context)
        if self.request.max_tokens is not None:
            room = min(room, self.request.max_tokens - len(self.token_ids) - 1)
        self.drafter.share_round(streams, tokens_left=room + 1, draft_sharers=draft_sharers,  # the round's own token included
                                 rows_before=rows_before)
        k = min(self._k, room)
        spent, resumed = 0.0, self.clock()  # this plan's own time: not the other streams' between its forwards
        if k > 0:
            steps = self.drafter.propose_steps(self.context, k, self._shaping, self.rng, guide=self.constraint)
            try:
                forward = next(steps)
                while True:
                    spent += self.clock() - resumed
                    reply = yield forward
                    spent, resumed = spent + reply.seconds, self.clock()
                    forward = steps.send(reply)
            except StopIteration as done:
                self._proposal = done.value
        else:
            self._proposal = Proposal(())
        self._drafted = len(self._proposal.draft_tokens)
        if self.constraint is not None:
            self._proposal = self._constrain(self._proposal, room)
        self.stats.draft_seconds += spent + self.clock() - resumed
        return [self.context[-1], *self._proposal.draft_tokens]

    def commit(self, target_logits: np.ndarray, seconds: float, alone: bool) -> StreamEvent:
        """The target evaluated the plan (its logits [k + 1, vocab], in `seconds`, this sequence
        `alone` in the forward or not): accept a prefix of the proposal and roll back the rest. A
        forward timed alone updates the cost model of `auto`."""
        self.target.record([self.context[-1], *self._proposal.draft_tokens])
        self.stats.verify_seconds += seconds
        alone_seconds = seconds if alone else None
        proposal = self._proposal
        draft_tokens = proposal.draft_tokens
        sampling = self._shaping  # row(i) has the logit_bias already
        row = self._target_row(target_logits, draft_tokens)
        if sampling.greedy:
            # Each row's argmax is taken when verification reaches it (a masked row costs a copy).
            verdict = verify_deterministic(draft_tokens, lambda i: int(np.argmax(row(i))))
        elif proposal.draft_probs is None:  # a deterministic proposal (or none): see sampling/verify.py
            first = len(self.context)  # the sequence position of target_logits[0]'s token
            verdict = verify_deterministic(draft_tokens, lambda i: sample_with(
                token_distribution(row(i), sampling), position_uniform(self.seed, first + i)))
        else:
            verdict = verify(draft_tokens, proposal.draft_probs,
                             lambda i: token_distribution(row(i), sampling), self.rng)
        self._record(proposal, verdict.num_accepted, alone_seconds)
        if self.constraint is not None:
            self.constraint.commit([*verdict.accepted_tokens, verdict.next_token])
        # Keep pending + the accepted drafts; the next token becomes the new pending one.
        self.target.truncate(len(self.context) + verdict.num_accepted)
        new_tokens: list[int] = []
        # Who produced each token: the proposal's source for accepted ones, the target for its own.
        drafter_source = proposal.source or self.request.spec.method
        sources = [drafter_source if i < self._drafted else GRAMMAR_SOURCE
                   for i in range(verdict.num_accepted)] + [TARGET_SOURCE]
        for token in (*verdict.accepted_tokens, verdict.next_token):
            if not self._emit(token):
                break
            new_tokens.append(token)
            if self.finished:  # a stop string or the token limit ended it mid-run
                break
        self._sources = sources[:len(new_tokens)]
        # Raw row i: the target's own distribution of committed token i (no bias, mask or filter).
        if self.request.logprobs is not None:
            self._logprobs = token_logprobs(target_logits, new_tokens, self.request.logprobs)
        if self.constraint is not None and not self.finished and self.constraint.finished:
            self._finish("stop")  # the grammar is complete: the end token it now forces ends the text
        if self.stats.ttft_seconds is None:
            self.stats.ttft_seconds = self.clock() - self._started_at
        event = self._event(new_tokens)
        # What this round proposed and kept, for the stream's `speculative` extension (server/speculative.py).
        event.round = RoundOutcome(drafter_source if draft_tokens else "", len(draft_tokens), verdict.num_accepted,
                                   tuple(draft_tokens[verdict.num_accepted:]))
        return event

    def cancel(self) -> StreamEvent:
        self._finish("cancelled")
        return self._event([])

    # -- helpers -----------------------------------------------------------------------------
    def _constrain(self, proposal: Proposal, room: int) -> Proposal:
        """The proposal cut at the first token the grammar forbids, then extended by the tokens it
        forces (not for `off`, plain decoding's baseline): their rows are verified like any draft's."""
        constraint = self.constraint
        if constraint is None:
            return proposal
        drafted = constraint.admissible(proposal.draft_tokens)
        tokens = proposal.draft_tokens[:drafted]
        probs = None if proposal.draft_probs is None else proposal.draft_probs[:drafted]
        self._drafted = drafted
        forced = [] if self.request.spec.method == OFF.name else constraint.forced_after(tokens, room - drafted)
        if forced and probs is not None:  # a forced token's q is one-hot, as any deterministic proposal's
            probs = np.concatenate([probs, np.stack([one_hot(t, probs.shape[-1]) for t in forced])])
        source = proposal.source if drafted else (GRAMMAR_SOURCE if forced else proposal.source)
        return Proposal((*tokens, *forced), probs if drafted else None, source)

    def _target_row(self, target_logits: np.ndarray, draft_tokens) -> Callable[[int], np.ndarray]:
        """Row i of the target's logits plus the request's logit_bias, then masked by the grammar
        state the proposal reached there (so no bias revives a token the grammar forbids). Without
        either, the rows themselves: nothing is copied."""
        logit_bias = self.request.sampling.logit_bias
        if self.constraint is None:
            if not logit_bias:
                return target_logits.__getitem__
            return lambda i: biased_logits(target_logits[i], logit_bias)
        constraint = self.constraint

        def masked(i: int) -> np.ndarray:
            allowed = constraint.allowed_after(draft_tokens[:i])
            if not allowed.any():
                raise SpecdecError("the grammar allows no token at this point of the output.")
            if not logit_bias:
                return np.where(allowed, target_logits[i], np.float32(-np.inf))
            biased = biased_logits(target_logits[i], logit_bias)  # a fresh copy: masked in place
            biased[~allowed] = -np.inf
            if biased.max() == -np.inf:
                raise SpecdecError("logit_bias bans every token the grammar allows at this point of the output.")
            return biased
        return masked

    def _record(self, proposal: Proposal, accepted: int, alone_seconds: Optional[float]) -> None:
        """Statistics and the drafter's lesson: the drafter's own tokens, the grammar's apart."""
        drafted = self._drafted
        forced = len(proposal.draft_tokens) - drafted
        mine = proposal if not forced else Proposal(
            proposal.draft_tokens[:drafted],
            None if proposal.draft_probs is None else proposal.draft_probs[:drafted], proposal.source)
        self.stats.record_round(drafted, min(accepted, drafted), mine.source if drafted else "")
        if forced:
            self.stats.record_forced(forced, max(0, accepted - drafted))
        # A forward that also verified forced rows says nothing of the drafter's row count.
        self.drafter.observe(mine, min(accepted, drafted), None if forced else alone_seconds)

    def _emit(self, token: int) -> bool:
        """Commit one token; returns False (and finishes) if it ends the generation unseen."""
        if ((token in self.target.backend.eog_token_ids or token in self.request.stop_token_ids)
                and not self.request.ignore_eos):
            self._finish("stop")
            return False
        self.context.append(token)
        self.token_ids.append(token)
        self.stats.generated_tokens += 1
        self.assembler.add(self.target.backend.token_bytes(token))
        if self.assembler.stopped:
            self._finish("stop")
        elif self.request.max_tokens is not None and len(self.token_ids) >= self.request.max_tokens:
            self._finish("length")
        elif len(self.context) > self.target.backend.n_ctx:
            self._finish("length")
        return True

    def _finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.assembler.finish()
            self.stats.total_seconds = self.clock() - self._started_at
            if self.history is not None and self.token_ids:
                # The prompt too: a tenant's prompts share templates that later answers copy.
                self.history.add(list(self.request.prompt_token_ids) + self.token_ids)

    def _event(self, new_tokens: list[int]) -> StreamEvent:
        delta = self.assembler.take_delta(final=self.finished)
        sources, self._sources = self._sources[:len(new_tokens)], []
        logprobs = (self._logprobs or []) if self.request.logprobs is not None else None
        self._logprobs = None
        if self.finished:
            return StreamEvent(delta, new_tokens, self.finish_reason, self.stats.as_dict(), sources, logprobs)
        return StreamEvent(delta, new_tokens, token_sources=sources, logprobs=logprobs)

