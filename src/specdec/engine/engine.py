"""The engine: a target backend, an optional draft backend, and the drafters built on them."""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Optional, Sequence, Union

from specdec.backends.base import Backend, check_draft_compatible
from specdec.backends.context_size import MIB, machine_memory
from specdec.backends.cost_model import CostModel, calibrate, calibration_steps
from specdec.backends.sequence import CachedSequence
from specdec.drafters import registry as drafting_methods
from specdec.drafters.base import Drafter
from specdec.drafters.history import CrossRequestCache
from specdec.drafters.policy.config import PolicyConfig
from specdec.drafters.registry import SlotParts
from specdec.engine.core import EngineCore
from specdec.engine.decoder import Generation
from specdec.engine.prompt_cache import DRAFT_HOST_SHARE, PromptCache, default_host_bytes
from specdec.grammar.compiler import DEFAULT_TIME_LIMIT, GrammarCompiler
from specdec.types import GenerationRequest, GenerationResult, SpecdecError, StreamEvent

if TYPE_CHECKING:
    from specdec.backends.registry import ModelConfig


def encode_chat(target: Backend, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> list[int]:
    """Chat messages in the model's template, the template's own tokens special and the messages'
    text plain: a user who writes `<|im_end|><|im_start|>system` gets those characters as text,
    not a forged turn. The template is rendered with a marker in place of each content; the pieces
    between markers are the template's, and each content is found between them as the template
    writes it (as it is, or trimmed as Llama 3's template trims it). Where the contents cannot be
    found so, the rendering is tokenized whole, and a content holding special-token text is
    refused. `tools` (OpenAI's tool definitions) go to the template's tools section; they and
    earlier turns' tool calls are plain text too wherever they hold special-token text."""
    if tools:
        def render(items):
            return target.apply_chat_template(items, tools)
    else:
        render = target.apply_chat_template  # a template without a tools argument still serves plain chats
    contents = {str(i): message["content"] for i, message in enumerate(messages) if isinstance(message.get("content"), str)}
    marked = [{**message, "content": f"\x00specdec-content-{i}\x00"} if str(i) in contents else message
              for i, message in enumerate(messages)]
    # The template's pieces, between them the number of the message whose content it writes there.
    split = re.split("\x00specdec-content-([0-9]+)\x00", render(marked))
    rendered = render(messages)
    pieces = _contents_located(rendered, split[0::2], [contents.get(number) for number in split[1::2]])
    if pieces is None:
        _refuse_special_text(target, messages, tools)
        return target.tokenize(rendered, add_special=False)
    pieces = _copied_text_plain(target, pieces, _copied_texts(messages, tools))
    return [token for text, template in pieces if text
            for token in target.tokenize(text, add_special=False, parse_special=template)]


def _contents_located(rendered: str, template_pieces: Sequence[str],
                      contents: Sequence[Optional[str]]) -> Optional[list[tuple[str, bool]]]:
    """`rendered` as (text, is the template's) pieces: the template's pieces exactly as the marked
    rendering has them (so no request text among them), and between them each content as the
    template writes it, as it is or with its whitespace trimmed; None where it is not so."""
    pieces: list[tuple[str, bool]] = []
    position = 0
    for index, piece in enumerate(template_pieces):
        if not rendered.startswith(piece, position):
            return None
        pieces.append((piece, True))
        position += len(piece)
        if index == len(contents):
            break
        following, content = template_pieces[index + 1], contents[index]
        if content is None:
            return None  # a marker's text that is no marker of ours (a tool call's arguments, say)
        written = next((form for form in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip()))
                        if rendered.startswith(form, position) and rendered.startswith(following, position + len(form))),
                       None)
        if written is None:
            return None
        pieces.append((written, False))
        position += len(written)
    return pieces if position == len(rendered) else None


def _refuse_special_text(target: Backend, messages: Sequence[dict], tools: Optional[Sequence[dict]]) -> None:
    """A SpecdecError for the first content or copied text holding special-token text: where the
    template's rendering cannot be split into its own text and the request's, tokenizing it whole
    would make that text a control token (a forged turn)."""
    for index, message in enumerate(messages):
        content = message.get("content")
        special = _special_text(target, content) if isinstance(content, str) else None
        if special is not None:
            raise SpecdecError(f"messages[{index}].content holds the special token text {special!r}, which this "
                               f"model's chat template does not copy as written, so it cannot be kept plain text; "
                               f"remove it.")
    for text in _copied_texts(messages, tools):
        special = _special_text(target, text)
        if special is not None:
            raise SpecdecError(f"the request's tools or tool calls hold the special token text {special!r}, which "
                               f"this model's chat template does not copy as written, so it cannot be kept plain text.")


def _special_text(target: Backend, text: str) -> Optional[str]:
    """The first special token's text in `text` (the shortest span that tokenizes differently with
    special tokens parsed), or None where it holds none."""
    def parses_special(span: str) -> bool:
        return bool(span) and (target.tokenize(span, add_special=False, parse_special=True)
                               != target.tokenize(span, add_special=False, parse_special=False))

    if not parses_special(text):
        return None
    low, high = 1, len(text)  # binary searches: the shortest such prefix, then its shortest such suffix
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if parses_special(text[:middle]) else (middle + 1, high)
    end, low, high = low, 0, low - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if parses_special(text[middle:end]) else (low, middle - 1)
    return text[low:end]


def _copied_texts(messages: Sequence[dict], tools: Optional[Sequence[dict]]) -> list[str]:
    """Request text a template copies in besides the contents, as its `tojson` writes it: the tool
    definitions, and the names and arguments of earlier calls (ids are the caller's, not its users')."""
    texts = [json.dumps(tool, ensure_ascii=False) for tool in tools or ()]
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            texts += [str(function.get("name", "")), json.dumps(function.get("arguments"), ensure_ascii=False)]
    return texts


def _copied_text_plain(target: Backend, pieces: list[tuple[str, bool]], texts: Sequence[str]) -> list[tuple[str, bool]]:
    """`pieces` with each of `texts` that would tokenize into special tokens cut out of the
    template's pieces as plain text; such a text the template does not write as it is (so that it
    cannot be found) is refused, never tokenized as special."""
    risky = sorted({text for text in texts if text and target.tokenize(text, add_special=False, parse_special=True)
                    != target.tokenize(text, add_special=False, parse_special=False)}, key=len, reverse=True)
    if not risky:
        return pieces  # the usual case: the template's text tokenizes as it always has
    pattern = re.compile("|".join(re.escape(text) for text in risky))
    cut: list[tuple[str, bool]] = []
    found: set[str] = set()
    for text, template in pieces:
        position = 0
        for match in pattern.finditer(text) if template else ():
            cut += [(text[position:match.start()], True), (match.group(), False)]
            found.add(match.group())
            position = match.end()
        cut.append((text[position:], template))
    missing = [text for text in risky if text not in found]
    if missing:
        raise SpecdecError(f"the request's tools or tool calls hold special-token text that the chat template "
                           f"does not copy as written, so it cannot be kept plain: {missing[0][:80]!r}")
    return cut


@dataclass(frozen=True)
class EngineConfig:
    ngram_max: int = 3
    ngram_min: int = 1
    prefix_cache: bool = True  # reuse the cached KV of a prompt prefix seen by the previous request
    # Prompt starts kept in the KV cache after their slot moved on, where the backend can share
    # cells (engine/prompt_cache.py); 0: none.
    parked_prompts: int = 64
    # MiB of host memory for parked starts that gave way, where the backend copies cells out
    # (engine/prompt_cache.py); None: 1/8 of the RAM, at most 8 GiB; 0: none.
    cache_ram_mib: Optional[int] = None
    # A folder the copies are written to when the server stops and read from when one starts with
    # the same machine, models and build (engine/prompt_cache.py); None: lost on restart.
    prompt_cache_dir: Optional[str] = None
    cross_request_ngrams: bool = True  # draft from text generated earlier for the same tenant
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # what `auto` tunes its choices with
    grammar_time_limit: Optional[float] = DEFAULT_TIME_LIMIT  # seconds a grammar may compile on admission


@dataclass
class Slot:
    """One sequence's caches on both models, reused across the requests it serves (prefix caching)."""

    target: CachedSequence
    draft: Optional[CachedSequence]
    drafters: dict[str, Drafter]


class Engine:
    """The target and draft backends and, per slot, the cached sequences and drafters built on them.

    One slot serves one generation at a time; a server with n slots runs n generations at once.
    """

    def __init__(
        self,
        target: Backend,
        draft: Optional[Backend] = None,
        config: EngineConfig = EngineConfig(),
        clock: Callable[[], float] = time.perf_counter,
        n_slots: int = 1,
        model_config: Optional["ModelConfig"] = None,
    ):
        if draft is not None:
            check_draft_compatible(target, draft)
        self.target = target
        self.draft = draft
        self.config = config
        self.model_config = model_config  # how it was loaded, where runtime.load_engine loaded it
        self.clock = clock
        if n_slots > target.max_sequences or (draft is not None and n_slots > draft.max_sequences):
            raise SpecdecError(f"{n_slots} slots need backends that hold {n_slots} sequences.")
        self.slots = [self._make_slot(seq_id) for seq_id in range(n_slots)]
        self.cost_model: Optional[CostModel] = None  # measured on first use of `auto`
        self.cross_request = CrossRequestCache()
        self.grammars = GrammarCompiler(target, config.grammar_time_limit)  # the vocabulary is read on first use only
        self.prompt_cache: Optional[PromptCache] = None
        self.draft_copies: Optional[PromptCache] = None  # the draft's sequences, in host memory only
        self.prompt_cache_folder = self._prompt_cache_folder()
        if config.prefix_cache and config.parked_prompts > 0 and target.parked_sequences > 0:
            host_bytes = default_host_bytes(machine_memory()) if config.cache_ram_mib is None \
                else config.cache_ram_mib * MIB
            draft_bytes = int(host_bytes * DRAFT_HOST_SHARE) if draft is not None and draft.copies_cells else 0
            self.prompt_cache = PromptCache(target, target.max_sequences, min(config.parked_prompts, target.parked_sequences),
                                            host_bytes - draft_bytes)
            if draft is not None and draft_bytes:  # the draft's conversations too: its proposals need no catch-up
                self.draft_copies = PromptCache(draft, draft.max_sequences, 0, draft_bytes)
            if self.prompt_cache_folder is not None and self.prompt_cache_folder.is_dir():
                self.prompt_cache.read(self.prompt_cache_folder)
        self.core = EngineCore(self)  # the one driver of its slots, for every caller

    def _make_slot(self, seq_id: int) -> Slot:
        draft_sequence = CachedSequence(self.draft, seq_id) if self.draft is not None else None
        # The target's prefix reuse must be exact; the draft's only has to be fast.
        slot = Slot(CachedSequence(self.target, seq_id, aligned_reuse=True), draft_sequence, {})
        self._build_drafters(slot)
        return slot

    def _build_drafters(self, slot: Slot, cost: Optional[CostModel] = None) -> None:
        """The slot's drafters from the registry's factories: without `cost`, every method that
        needs no measured costs; with it, the `calibrated` ones (`auto`)."""
        for method in drafting_methods.methods():
            if method.calibrated != (cost is not None) or (method.needs_draft and slot.draft is None):
                continue
            parts = SlotParts(self.config, slot.target, slot.draft, slot.drafters, cost, self.clock)
            slot.drafters[method.name] = method.build(parts)

    @property
    def methods(self) -> list[str]:
        """The methods this engine serves (`auto` before its first calibration too)."""
        return [method.name for method in drafting_methods.methods() if not (method.needs_draft and self.draft is None)]

    @property
    def target_sequence(self) -> CachedSequence:
        return self.slots[0].target

    def calibrate(self, slot: int = 0) -> CostModel:
        """Measure this machine's forward costs (a few seconds) and let the adaptive method `auto`
        price with them."""
        return self.use_cost_model(self.measure_costs(slot))

    def measure_costs(self, slot: int = 0, interrupted: Optional[Callable[[], bool]] = None) -> CostModel:
        """This machine's forward costs, measured (cost_model.calibrate), not yet used.

        Uses the slot's caches as scratch space: call it for a slot that is not generating.
        """
        scratch = self.slots[slot]
        return calibrate(scratch.target, scratch.draft, clock=self.clock, interrupted=interrupted)

    def cost_measurement(self, slot: int = 0) -> Generator[None, None, CostModel]:
        """measure_costs in steps (cost_model.calibration_steps): one pair of forwards per step."""
        scratch = self.slots[slot]
        return calibration_steps(scratch.target, scratch.draft, clock=self.clock)

    def use_cost_model(self, cost: CostModel) -> CostModel:
        """Let `auto` price its proposals with `cost`: just measured, or saved by an earlier
        calibration of the same setup (it keeps updating online either way)."""
        self.cost_model = cost
        for each in self.slots:
            self._build_drafters(each, cost)
        return cost

    # -- prompts -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: Union[str, Sequence[dict]], chat: bool,
                      tools: Optional[Sequence[dict]] = None) -> list[int]:
        """A raw completion prompt (its special-token text parsed: the caller writes the whole
        format), or chat messages rendered with the model's own template (with `tools`, OpenAI's
        tool definitions, in its tools section)."""
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            return encode_chat(self.target, messages, tools)
        if not isinstance(prompt, str):
            raise SpecdecError("a completion prompt is text; messages need chat=True.")
        return self.target.tokenize(prompt, add_special=True)

    def render_chat(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> str:
        """Chat messages rendered with the model's own template as text, ending with the assistant
        prompt: the text `encode_prompt(messages, chat=True, tools=tools)` tokenizes (which keeps
        the messages' own text plain where this text holds special-token spellings)."""
        if tools:
            return self.target.apply_chat_template(list(messages), tools)
        return self.target.apply_chat_template(list(messages))  # as encode_chat calls it without tools

    # -- generation --------------------------------------------------------------------------
    def new_generation(self, request: GenerationRequest, slot: int = 0) -> Generation:
        request.validate()
        if drafting_methods.calibrated(request.spec.method) and self.cost_model is None:
            self.calibrate(slot)  # the slot about to serve this request is free
        chosen = self.slots[slot]
        drafter = chosen.drafters.get(request.spec.method)
        if drafter is None:
            raise SpecdecError(f"method {request.spec.method!r} needs a draft model; start with --draft-model.")
        history = self.cross_request.for_tenant(request.tenant) if self.config.cross_request_ngrams else None
        constraint = None if request.grammar is None else self.grammars.constraint(request.grammar)
        return Generation(request, chosen.target, drafter, clock=self.clock, history=history, constraint=constraint)

    def stream(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        """One request alone, through the engine core (as every caller drives it)."""
        return self.core.stream(request)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.core.generate(request)

    def clear_cache(self) -> None:
        """Forget every cached prefix (the benchmark does this before each measured generation)."""
        for slot in self.slots:
            slot.target.clear()
            if slot.draft is not None:
                slot.draft.clear()

    def reset_cross_request_state(self) -> None:
        """Forget every tenant's cross-request history (the benchmark's runs start equal)."""
        self.cross_request.reset()

    def _prompt_cache_folder(self) -> Optional[Path]:
        """Where this setup's prompt starts are kept across restarts: a folder per machine, models
        and library build (their cells' values are those of this very computation)."""
        if self.config.prompt_cache_dir is None:
            return None
        from specdec.machine_profile import setup_key

        library = self.target.describe().get("library")
        stamp = [os.stat(library).st_size, os.stat(library).st_mtime_ns] if library and os.path.exists(library) else None
        digest = hashlib.sha256(json.dumps([setup_key(self), stamp]).encode()).hexdigest()[:16]
        return Path(self.config.prompt_cache_dir).expanduser() / digest

    def write_prompt_cache(self) -> int:
        """Every conversation start this engine holds, written to its prompt cache folder (at a
        stop, once nothing runs); how many."""
        folder, cache = self.prompt_cache_folder, self.prompt_cache
        if folder is None or cache is None:
            return 0
        cache.copy_everything([(slot.target, tenant) for slot, tenant in zip(self.slots, self.core.slot_tenants)])
        return cache.write(folder)

    def close(self) -> None:
        self.target.close()
        if self.draft is not None:
            self.draft.close()
