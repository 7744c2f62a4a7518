"""The speculative decoding loop: draft -> verify in one target forward -> commit -> roll back.

Invariant between rounds: the target's cache holds every committed token but the last one
("pending"); a round evaluates [pending, d1..dk] in one forward, which yields the target's
distribution at each draft position plus one. Plain decoding is the same loop with k = 0.
"""
from __future__ import annotations

import secrets
import time
from typing import Callable, Optional

import numpy as np

from specdec.drafters.base import Drafter
from specdec.drafters.history import TenantHistory
from specdec.engine.sequence import CachedSequence
from specdec.engine.stats import GenerationStats
from specdec.engine.stopping import TextAssembler
from specdec.sampling.probs import position_uniform, sample_with, token_distribution
from specdec.sampling.verify import verify, verify_deterministic, verify_greedy
from specdec.types import GenerationRequest, Proposal, SpecdecError, StreamEvent


TARGET_SOURCE = "target"  # a token the target chose itself (every round's last)


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
    ):
        prompt = request.prompt_token_ids
        if not prompt:
            raise SpecdecError("the prompt is empty.")
        if len(prompt) >= target.backend.n_ctx:
            raise SpecdecError(f"the prompt has {len(prompt)} tokens but the context holds only {target.backend.n_ctx}.")
        self.request = request
        self.target = target
        self.drafter = drafter
        self.clock = clock
        self.history = history  # the tenant's cross-request history: drafts from it, learns our text
        # Sampling noise: keyed by (seed, position) for the target's own tokens, so off, n-gram
        # drafting and auto's n-gram rounds sample the same text for one seed; a sequence for the
        # draft model's proposals and their acceptance (Leviathan's rule with its q).
        self.seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(64)
        self.rng = np.random.default_rng([self.seed, 1 << 64])  # a stream no position key collides with
        self.context: list[int] = list(request.prompt_token_ids)  # prompt + generated; last = pending
        self.token_ids: list[int] = []
        self.assembler = TextAssembler(request.stop)
        self.finish_reason: Optional[str] = None
        k = request.spec.num_draft_tokens if request.spec.method != "off" else 0
        self.stats = GenerationStats(method=request.spec.method, num_draft_tokens=k)
        self._k = k
        self._proposal: Optional[Proposal] = None
        self._sources: list[str] = []  # of the tokens the next event carries
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
        self.drafter.share_round(streams)
        k = min(self._k, self.target.backend.n_ctx - len(self.context))
        if self.request.max_tokens is not None:
            k = min(k, self.request.max_tokens - len(self.token_ids) - 1)
        t0 = self.clock()
        if k > 0:
            self._proposal = self.drafter.propose(self.context, k, self.request.sampling, self.rng)
        else:
            self._proposal = Proposal(())
        self.stats.draft_seconds += self.clock() - t0
        return [self.context[-1], *self._proposal.draft_tokens]

    def commit(self, target_logits: np.ndarray, alone_seconds: Optional[float] = None) -> StreamEvent:
        """Accept a prefix of the proposal given the target's logits [k + 1, vocab]; roll back the rest.
        `alone_seconds`: the forward's time when it evaluated this sequence alone (it updates the
        cost model of `auto`)."""
        proposal = self._proposal
        draft_tokens = proposal.draft_tokens
        k = len(draft_tokens)
        sampling = self.request.sampling
        if sampling.greedy:
            verdict = verify_greedy(draft_tokens, np.argmax(target_logits, axis=-1))
        elif proposal.draft_probs is None:  # a deterministic proposal (or none): see sampling/verify.py
            first = len(self.context)  # the sequence position of target_logits[0]'s token
            verdict = verify_deterministic(draft_tokens, lambda i: sample_with(
                token_distribution(target_logits[i], sampling), position_uniform(self.seed, first + i)))
        else:
            verdict = verify(draft_tokens, proposal.draft_probs,
                             lambda i: token_distribution(target_logits[i], sampling), self.rng)
        self.stats.record_round(k, verdict.num_accepted, proposal.source)
        self.drafter.observe(proposal, verdict.num_accepted, alone_seconds)
        # Keep pending + the accepted drafts; the next token becomes the new pending one.
        self.target.truncate(len(self.context) + verdict.num_accepted)
        new_tokens: list[int] = []
        # Who produced each token: the proposal's source for accepted ones, the target for its own.
        sources = [proposal.source or self.request.spec.method] * verdict.num_accepted + [TARGET_SOURCE]
        for token in (*verdict.accepted_tokens, verdict.next_token):
            if not self._emit(token):
                break
            new_tokens.append(token)
            if self.finished:  # a stop string or the token limit ended it mid-run
                break
        self._sources = sources[:len(new_tokens)]
        if self.stats.ttft_seconds is None:
            self.stats.ttft_seconds = self.clock() - self._started_at
        return self._event(new_tokens)

    def cancel(self) -> StreamEvent:
        self._finish("cancelled")
        return self._event([])

    # -- helpers -----------------------------------------------------------------------------
    def _emit(self, token: int) -> bool:
        """Commit one token; returns False (and finishes) if it ends the generation unseen."""
        if token in self.target.backend.eog_token_ids and not self.request.ignore_eos:
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
        if self.finished:
            return StreamEvent(delta, new_tokens, self.finish_reason, self.stats.as_dict(), sources)
        return StreamEvent(delta, new_tokens, token_sources=sources)

