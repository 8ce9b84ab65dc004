"""Generate text with speculative decoding: the Python API, as mlx-lm's ``generate``
module (the command, ``python -m mlx_eagle.generate``, is a package of its own, so that its
--help loads no model code). A request's path reads down the imports: plan the drafts,
make the decoder over the conversation's cache, read the prompt, run rounds (a batch of
replies: scheduler.py)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Dict, Generator, Iterator, List, Optional, Sequence, Tuple, \
    Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, NaiveStreamingDetokenizer, SPMStreamingDetokenizer

from .costs import LONG_CONTEXT
from .decoder import PromptChunk, Round, SpeculativeDecoder
from .distributed import Watchdog, shared_seed
from .errors import UserError
from .grammar import grammar_for
from .node_odds import NodeOdds
from .options import DEFAULT_MAX_TOKENS, ReplyOptions
from .plan import DraftPlan, drafters_failed, plan_drafts, source_statistics
from .prompt_cache import PromptCache, make_prompt_cache
from .thinking import thinking_budget_for

if TYPE_CHECKING:
    from .drafters import Drafter
    from .drafters.composite import SourceStats
    from .trees import TreeSpec


@dataclass
class GenerationResponse:
    """One generated token, as mlx-lm's stream_generate yields them, plus speculation
    statistics: ``accepted`` draft tokens in this token's round; ``logprobs`` (asked
    for with ``logprobs=True``, as mlx-lm always gives them): the target's log-probabilities
    over its vocabulary at this token, from the very pass that chose it; ``tokens_per_forward``
    (tau): tokens produced per target forward pass so far, the target's own (bonus) token
    of each round included; ``prompt_reused``: prompt tokens found already in the
    ``prompt_cache`` (not read again); ``sources``: per drafter, the nodes it added to
    the verified trees and how many of them were accepted; ``rechecked``: greedy
    positions whose top two logits lay too close to trust a block's rounding, decided
    by a one-row pass as plain decoding decides them; ``batch_rows`` and ``nodes_per_round``:
    per round of this reply so far, the conversations its verify pass held (1: alone) and
    the draft nodes verified for this one; ``stop_sequence``: the stop string that ended the
    reply; ``drafting``: what drafts, and ``drafting_off``: which drafters do not draft here (or
    failed during this conversation), and why."""

    text: str
    token: int
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    accepted: int = 0
    tokens_per_forward: float = 0.0
    target_forwards: int = 0
    prompt_reused: int = 0
    sources: Dict[str, "SourceStats"] = field(default_factory=dict)
    rechecked: int = 0
    logprobs: Optional[mx.array] = None  # with logprobs=True: the target's log-probabilities the token was chosen from
    batch_rows: float = 1.0
    nodes_per_round: float = 0.0
    stop_sequence: Optional[str] = None  # the stop string that ended the reply (None: another end)
    drafting: str = ""  # what drafts for this reply, in words
    drafting_off: List[str] = field(default_factory=list)  # drafters that do not draft here, or failed, and why


def prompt_ids(tokenizer, prompt: Union[str, List[int], mx.array]) -> List[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, mx.array):
        return prompt.tolist()
    return list(prompt)


# MLX keeps freed buffers for reuse; mlx-lm's plain loop frees them every 256 tokens. A
# speculative round adds several tokens, so the cache is cleared whenever a round crosses
# a multiple of this (never only at exact multiples, which rounds jump over), and after
# every reply: on Metal a long reply's cache otherwise grows without bound.
CLEAR_CACHE_EVERY = 256


class StopMatcher:
    """Hands out a growing text piece by piece, cut before the first stop string; while
    the text may still grow, a tail that could begin a stop string is held back."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.shown = 0  # characters already handed out

    def feed(self, text: str, final: bool) -> Tuple[str, Optional[str]]:
        """The new piece of ``text`` (all of it so far) to show, and the stop string that
        ended it (None: none did). ``final``: the text will not grow again."""
        found = [(at, stop) for stop in self.stops for at in [text.find(stop, max(0, self.shown - len(stop)))]
                 if at >= 0]
        cut, stop = min(found, default=(-1, None))
        if cut >= 0:
            text = text[:cut]
        elif not final and self.stops:
            text = text[:max(self.shown, len(text) - max(len(s) for s in self.stops) + 1)]
        piece, self.shown = text[self.shown:], max(self.shown, len(text))
        return piece, stop


def continuing_detokenizer(tokenizer, before: int):
    """A streaming detokenizer whose ``text`` is exactly what a reply's tokens add after the
    token ``before`` them: mlx-lm's for the tokenizer (its speed), kept from dropping the
    first token's leading space, which it trims as the start of a text. A completion or a
    fill-in-the-middle continues text, where that space is the model's own. (Another
    detokenizer, a tokenizer's own, is used as it is.)"""
    detokenizer = tokenizer.detokenizer
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        detokenizer.trim_space = False
    elif isinstance(detokenizer, BPEStreamingDetokenizer):
        detokenizer._maybe_trim_space = lambda text: text  # (its one trim: the text's first space)
    elif isinstance(detokenizer, NaiveStreamingDetokenizer):  # the tokenizer's decode, which may trim a first token
        detokenizer = _DecodedAfter(tokenizer, before)
    detokenizer.reset()
    return detokenizer


class _DecodedAfter:
    """Any tokenizer's text a line at a time (as mlx-lm's NaiveStreamingDetokenizer), each
    line decoded after the token before it and cut after that token's own text."""

    def __init__(self, tokenizer, before: int):
        self.decode, self.before = tokenizer.decode, before

    def reset(self) -> None:
        self.tokens, self.done, self.line = [], "", [self.before]

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self.line.append(token)

    def finalize(self) -> None:
        self.done, self.line = self.text, self.line[-1:]

    @property
    def text(self) -> str:
        head, whole = self.decode(self.line[:1]), self.decode(self.line)
        current = whole[len(head):] if whole.startswith(head) else self.decode(self.line[1:])
        if current.endswith("\n"):
            self.done, self.line, current = self.done + current, self.line[-1:], ""
        return self.done + current.rstrip("\ufffd")  # (a character whose bytes have not all come)


def _context_length(model: nn.Module) -> Optional[int]:
    return getattr(model.args, "max_position_embeddings", None)


def check_prompt(model: nn.Module, ids: Sequence[int]) -> None:
    """One line for a prompt that cannot be answered: empty, or too long for the model's
    context. Every entry point asks this before any work (planning may time the device)."""
    if not len(ids):
        raise UserError("the prompt is empty")
    limit = _context_length(model)
    if limit is not None and len(ids) >= limit:
        raise UserError(f"the prompt is {len(ids)} tokens; the model's context holds {limit}. Shorten it")


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    draft: Union["DraftPlan", "Drafter", type, nn.Module, str, None] = None,
    tree: Union[str, "TreeSpec", None] = None,
    lookup: bool = True,
    prompt_cache: Optional["PromptCache"] = None,
    history: Union[bool, str, None, object] = True,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: Optional[int] = None,
    options: Optional[ReplyOptions] = None,
    **reply: Any,
) -> Generator[GenerationResponse, None, None]:
    """Yield the continuation of ``prompt`` token by token.

    ``draft``: what drafts (see mlx_eagle.plan): a ``DraftPlan``; a head from
    ``load_draft`` or ``load(..., draft=...)``; your own ``mlx_eagle.Drafter`` object or
    class (fresh per conversation), or its "package.module:Name"; "auto" (the model's own
    drafter, if any), "lookup" or None (drafts from the context alone), or "none" (plain
    decoding through the same loop). With ``lookup=False`` a drafter drafts alone. ``tree``: a head's --tree spec;
    ``auto`` (default) takes the tree tuned for this device, else one built once from
    the head's recorded acceptance and a few timed forward passes here, or no head tree
    where none is expected to pay off. ``lookup``: also draft from the context
    (continuations of the last few tokens' earlier occurrences in the prompt and
    reply), as long a draft as this device's measured costs and the drafts' acceptance
    so far say pays off. A plan already says all of this: ``tree`` and ``lookup`` are
    for the other choices. The text is exactly what the target alone would produce:
    the same tokens when greedy (temp 0), the same distribution when sampling.
    ``prompt_cache`` (``make_prompt_cache``): keep it across the turns of a conversation
    and pass the whole conversation each time; the part the cache already holds is not
    read again. Stopping the iteration between tokens leaves it usable. ``history``: the
    earlier replies context drafts also draft from (True: this process's for this model;
    a path: a file kept across processes; False: none); a plan says this itself.
    ``prompt_progress_callback(read, total)``: called as the prompt is read, chunk by chunk,
    as mlx-lm's is (an exception it raises stops the reading and the generation).
    ``kv_bits``, ``kv_group_size``, ``quantized_kv_start``: quantized KV caches, as mlx-lm's
    (target.KVQuantization; ``quantized_kv_start`` None: mlx-lm's default, 5000): the text is
    plain mlx-lm decoding's with the same settings.
    The reply's own settings, as keywords (``temp``, ``top_p``, ``min_p``, ``top_k``, ``seed``,
    ``stop``, ``stop_tokens``, ``logprobs``: each response carries the target's
    log-probabilities at its token; ``response_format``: a grammar, ``{"type": "json_object"}``
    or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, drafting still on and the
    text exactly what the target produces with the grammar's mask applied at every step;
    ``thinking_budget``: a reasoning model's thinking ended after that many tokens, as plain
    decoding with the same rule ends it), or all at once as ``options``
    (mlx_eagle.options.ReplyOptions says each).
    """
    options = reply_options(options, max_tokens, reply)
    ids = prompt_ids(tokenizer, prompt)
    check_prompt(model, ids)  # before planning, which may time the device
    plan = plan_drafts(model, draft, tree, lookup, history, tokenizer, kv_bits, kv_group_size, quantized_kv_start)
    generation = Generation(model, tokenizer, ids, options, plan, prompt_cache)
    try:
        for read, total in generation.read():
            if prompt_progress_callback is not None:
                prompt_progress_callback(read, total)
        yield from generation.first()
        while not generation.done:
            yield from generation.conclude(generation.decoder.round(generation.room()))
    finally:  # the reply is final, however it ended: the caches hold what was shown, drafters keep it
        generation.close()


def reply_options(options: Optional[ReplyOptions], max_tokens: int, reply: Dict[str, Any]) -> ReplyOptions:
    """``options``, or the one ``max_tokens`` and the ``reply`` keywords make (not both: a
    setting given beside ``options`` would be silently lost)."""
    if options is None:
        return ReplyOptions.of(max_tokens=max_tokens, **reply)
    if reply or max_tokens != DEFAULT_MAX_TOKENS:
        given = sorted(reply) + (["max_tokens"] if max_tokens != DEFAULT_MAX_TOKENS else [])
        raise UserError(f"give reply settings either as options or as keywords, not both ({', '.join(given)})")
    return options


class Generation:
    """One reply, step by step, as stream_generate and the scheduler run it: ``read`` reads
    the prompt a chunk at a time, ``first`` gives the first token's responses; while not
    ``done``, each round of at most ``room()`` tokens (``decoder.round``, or a batch's
    ``decoder.batched_round``) is handed to ``conclude``, which gives its responses (up to the
    one that ends the reply); ``close``, however it ended, leaves the caches holding what was
    handed out. ``ids``: the prompt; ``options``: the reply's settings; ``plan``: what drafts
    (plan.plan_drafts), whose KV settings the caches follow; ``prompt_cache``: the
    conversation's (None: a fresh one)."""

    def __init__(self, model: nn.Module, tokenizer, ids: List[int], options: ReplyOptions, plan: DraftPlan,
                 prompt_cache: Optional[PromptCache] = None):
        self.ids, self.options = ids, options
        check_prompt(model, ids)
        budget = thinking_budget_for(tokenizer, ids, options.thinking_budget, model.args.vocab_size,
                                     options.response_format)
        self.grammar = grammar_for(tokenizer, model.args.vocab_size, options.response_format) or budget
        self.limit = _context_length(model)
        self.plan = plan
        self.cache = cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
        if cache.unfinished:  # a prompt read or round that never finished: nothing in it is certain
            cache.clear(model)
        if cache.plan_key != plan.key:  # a conversation keeps its drafters (and their caches) while its plan holds
            cache.drafter, cache.plan_key = plan.drafter(), plan.key
        self.decoder = SpeculativeDecoder(model, cache.drafter, options.sampling, shared_seed(options.seed), cache,
                                          costs=(lambda: plan.settings.costs) if plan.active else None,
                                          grammar=self.grammar, kv=plan.settings.kv, keep_logits=options.logprobs,
                                          odds=NodeOdds(prior=plan.odds))
        self.eos = set(tokenizer.eos_token_ids) | set(options.stop_tokens)
        self.stops = StopMatcher(options.stop)
        self.detokenizer = continuing_detokenizer(tokenizer, self.ids[-1])
        self.watchdog = Watchdog()  # a rank that hangs ends the others (distributed.py; idle on one machine)
        self.generated = self.produced = self.rounds = self.accepted = self.rows = self.nodes = 0
        self.done = False
        self.prompt_tps = 0.0
        self.tic = time.perf_counter()
        self.sources: Dict[str, "SourceStats"] = {}
        self.drafting, self.off_here = plan.describe(), plan.off
        self.drafting_off = self.off_here  # and the drafters that failed during the conversation
        self._reading: Optional[Iterator[Tuple[int, int]]] = None  # the prompt's reading, while it goes on

    def read(self) -> Iterator[Union[Tuple[int, int], PromptChunk]]:
        """Read the prompt, a chunk at a time: (read, total) after each, as stream_generate's
        prompt_progress_callback hears them; where the decoder ``rides``, a PromptChunk
        before each chunk read in a batch's pass (the caller runs it, then reads on)."""
        self._reading = reading = self.decoder.reading(self.ids)
        seconds = 0.0
        while True:
            tic = time.perf_counter()  # (only the reading's own time: a batch reads between rounds)
            progress = next(reading, None)
            seconds += time.perf_counter() - tic
            self.watchdog.kick()
            if progress is None:
                break
            tic = time.perf_counter()
            yield progress
            if isinstance(progress, PromptChunk):  # (its pass, shared with the rounds, counts as the reading's)
                seconds += time.perf_counter() - tic
        self._reading = None
        self.prompt_tps = (len(self.ids) - self.decoder.reused) / max(seconds, 1e-9)
        if self.plan.active and len(self.ids) >= LONG_CONTEXT:  # rounds this deep are priced by forwards timed
            self.plan.settings.costs.measure_long()  # this deep, once per device and setting: after the reading

    def first(self) -> Iterator[GenerationResponse]:
        """Once the prompt is read: the first token's response."""
        logprobs = _log_softmax(self.decoder.root_logits[None]) if self.options.logprobs else None
        self.tic = time.perf_counter()
        self.sources = source_statistics(self.cache.drafter)
        return self._responses([self.decoder.root], [False], logprobs)

    def room(self) -> int:
        """How many tokens the next round may produce."""
        room = self.options.max_tokens - self.generated
        return room if self.limit is None else min(room, self.limit - self.decoder.length)

    def conclude(self, result: Round) -> Iterator[GenerationResponse]:
        """The responses of a round's tokens, up to the one that ends the reply."""
        self.watchdog.kick()
        length = self.decoder.length
        if (length // CLEAR_CACHE_EVERY) != ((length - len(result.tokens)) // CLEAR_CACHE_EVERY):
            mx.clear_cache()  # a round crossed a boundary (multi-token rounds jump over exact multiples)
        self.rounds += 1
        self.rows += result.rows
        self.nodes += result.drafted
        self.produced += len(result.tokens)
        self.accepted = len(result.tokens) - 1
        self.sources = source_statistics(self.cache.drafter)
        self.drafting_off = self.off_here + drafters_failed(self.cache.drafter)
        if self.grammar is not None and self.grammar.forced.proposed:
            self.sources = {**self.sources, self.grammar.forced_source: replace(self.grammar.forced)}
        logprobs = _log_softmax(result.logits) if self.options.logprobs else None
        return self._responses(result.tokens, [True] * self.accepted + [False], logprobs)

    def _responses(self, tokens: List[int], from_draft: List[bool],
                   logprobs: Optional[List[mx.array]]) -> Iterator[GenerationResponse]:
        for index, (token, drafted) in enumerate(zip(tokens, from_draft)):
            self.generated += 1
            finish = None
            if token in self.eos:
                finish = "stop"
            else:
                self.detokenizer.add_token(token)
            if finish is None and self.generated >= self.options.max_tokens:
                finish = "length"
            if finish is None and self.limit is not None and len(self.ids) + self.generated >= self.limit:
                finish = "length"
            if finish is not None:
                self.detokenizer.finalize()
            segment, stopped_by = self.stops.feed(self.detokenizer.text, final=finish is not None)
            if stopped_by is not None:
                finish = "stop"
            elapsed = time.perf_counter() - self.tic
            self.done = finish is not None
            yield GenerationResponse(
                text=segment, token=token, from_draft=drafted, prompt_tokens=len(self.ids),
                prompt_tps=self.prompt_tps, generation_tokens=self.generated,
                generation_tps=self.generated / elapsed if elapsed > 0 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish,
                accepted=self.accepted, tokens_per_forward=self.produced / self.rounds if self.rounds else 0.0,
                target_forwards=self.decoder.forwards, prompt_reused=self.decoder.reused,
                sources=self.sources, rechecked=self.decoder.rechecked,
                logprobs=logprobs[index] if logprobs is not None else None,
                batch_rows=self.rows / self.rounds if self.rounds else 1.0,
                nodes_per_round=self.nodes / self.rounds if self.rounds else 0.0,
                stop_sequence=stopped_by, drafting=self.drafting, drafting_off=self.drafting_off,
            )
            if self.done:
                return

    def close(self) -> None:
        """However the reply ended: the caches hold what was handed out, drafters keep it (a
        reply stopped while its prompt was read: what the finished chunks read)."""
        if self._reading is not None:
            self._reading.close()  # (decoder._chunk_read keeps it)
            self._reading = None
        self.watchdog.stop()
        self.decoder.truncate(len(self.ids) + self.generated)
        if self.cache.drafter is not None:
            self.cache.drafter.finish()
        mx.clear_cache()


def _log_softmax(logits: mx.array) -> List[mx.array]:
    """Rows of logits as log-probabilities, in float32, as mlx-lm computes them; evaluated
    here, row by row, so that another thread may read them (the Engine's callers)."""
    logits = logits.astype(mx.float32)
    rows = list(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    mx.eval(rows)
    return rows


def generate(model: nn.Module, tokenizer, prompt: Union[str, List[int]], verbose: bool = False,
             **kwargs) -> str:
    """The whole continuation as a string; keyword arguments as for stream_generate."""
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        text += response.text
        if verbose:
            print(response.text, end="", flush=True)
    if verbose and response is not None:
        print()
        print_stats(response)
    return text


def print_stats(response: GenerationResponse, file=None) -> None:
    file = file or sys.stderr  # (looked up now: the stream may have been replaced since import)
    print(
        f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens/s | "
        f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s | "
        f"tau: {response.tokens_per_forward:.2f} tokens per target forward | "
        f"peak memory: {response.peak_memory:.2f} GB",
        file=file,
    )
    if response.sources:
        print("drafted: " + "; ".join(f"{name}: {stats.accepted} of {stats.proposed} accepted"
                                      for name, stats in response.sources.items())
              + (f" | rechecked alone: {response.rechecked}" if response.rechecked else ""), file=file)
