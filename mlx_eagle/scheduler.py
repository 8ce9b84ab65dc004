"""Many conversations at once, on an Engine's worker thread.

Requests wait for a seat (at most ``max_concurrency`` replies in progress, at most
``max_queue`` waiting: past that a request is refused with ``Busy``). Each turn of the
worker then:
1. drops what was cancelled (a reply leaves between rounds; the others never notice);
2. seats what waits, each in its conversation's prompt-cache slot (a request whose long
   beginning another's prompt is reading waits for that reading, then copies it);
3. reads new prompts for about ``PASS_SECONDS`` (at most ``PROMPT_TOKENS_PER_TURN`` tokens),
   the one with the least left to read first, in passes sized to that time, so a long prompt
   never holds the replies in progress back by more than that a turn, and a request that
   arrives waits for at most one pass of it (``ALONE_PASS_SECONDS`` while it is read alone);
   while replies decode in a packed pass, prompts' chunks are read inside it instead, sized
   to add ``RIDE_SHARE`` of its time (more where prompts outnumber the replies:
   ``ride_share``), or a prompt's whole rest where that adds at most a pass's time
   (``RIDE_PROMPTS``);
4. gives every reply in progress one round, their blocks verified in one packed forward pass
   (decoder.batched_round, with that chunk) where the target allows, each alone where not (a
   hybrid's recurrent layers, a sharded model).
Each conversation keeps its own drafters, sampling noise, grammar, stops and cache slot: its
reply is the one it gets served alone (tests/test_batch.py, tests/test_engine_batch.py).

What a caller reads comes through its request's queue, on its own thread: prompt progress,
responses, an error, then DONE (``Reply``).
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.nn as nn
import numpy as np

from .decoder import PromptChunk, batched_round, batches
from .drafters import common_prefix
from .errors import Busy, UserError
from .generation import Generation, GenerationResponse, check_prompt, prompt_ids
from .options import ReplyOptions
from .plan import plan_drafts
from .prompt_cache import PromptCache, PromptCaches

DONE = object()  # the end of a request's queue
PROMPT_TOKENS_PER_TURN = 512  # new prompts' tokens read a turn, all together (the decoder's chunk)
# A turn's prompt reading takes about this long, in passes sized to it at the prompt's pace
# (FIRST_CHUNK tokens while that is not known): a reply in progress, or a request that
# arrives, waits for at most that much of another's long prompt. Deep in a long context a
# token's pass costs more than the bound (on a 2-core CPU, about 45 ms a token at 8k tokens
# of context, 150 ms at 27k), so a pass may hold a single token. Small passes read a long
# prompt more slowly (there, about half its pace in 512-token passes deep in the context),
# which a request that arrives does not wait for. ALONE_PASS_SECONDS bounds the passes of a
# prompt read with nothing else live or waiting: 2 s read it about a quarter faster there,
# and an arrival waits about a second more (benchmarks/fair_reading.py).
PASS_SECONDS = 0.5
ALONE_PASS_SECONDS = 0.5
MIN_CHUNK = 1
FIRST_CHUNK = 64
# Where replies decode in a packed pass, a new prompt's chunk is read inside it (one pass
# over the weights for both), sized to add at most RIDE_SHARE of the pass's time without it:
# the replies' time between tokens grows by about that much while a long prompt is read
# beside them, not by a pass of PASS_SECONDS. (benchmarks/riding_prompts.py compares.)
# Where prompts outnumber the replies, more (ride_share).
RIDE_PROMPTS = True
RIDE_SHARE = 0.5
FIRST_RIDE = 16  # a chunk read inside a pass before any prompt has ridden (no pace known: _ride_chunk)
RIDE_DECAY = 0.8  # how much a chunk read in a pass weighs in the pace of the next (the rest: its own)
RIDE_REFRESH = 8  # after this many passes in a row with a chunk, one without (the rounds' own time, as it grows)
PASSES_KEPT = 16  # a prompt's passes of its own its next chunk is sized from
KEEPALIVE_SECONDS = 5.0  # a waiting caller's on_wait is called this often (a server's keep-alive)
# A beginning at least this long, shared with a prompt being read and not yet held in the
# caches, is copied once that reading ends rather than read again beside it, where the reading
# has at most SHARED_WAIT times as many tokens left: agents starting together share their
# system prompt and tools, while a short request never waits long for another's long prompt.
SHARED_READ = 64
SHARED_WAIT = 2
# A reply's time in its seat assumed before any has finished (Retry-After's first estimate):
# a few hundred tokens at the speeds of a small model on a CPU.
REPLY_SECONDS_PRIOR = 30.0
MAX_RETRY_AFTER = 600  # seconds


def chunk_for(seconds: float, passes: Sequence[Tuple[int, float]]) -> Optional[int]:
    """The prompt tokens a pass of its own reads in about ``seconds``, from its last
    ``passes`` (tokens, seconds): along a line fitted through them, a pass's floor (the
    weights read once, whatever it holds) plus a time per token; through the origin where
    they all held as many tokens. Where the floor passes half the bound (a large model on a
    slow device: on this CPU, Qwen2.5-Coder-1.5B's floor is about 0.7 s), a pass of twice
    its floor: the bound cannot be met, and passes sized to it by their pace alone shrank to
    a token or two, reading a 657-token prompt 7 times slower (measured with SmolLM2 and a
    bound of 0.05 s). At most PROMPT_TOKENS_PER_TURN (``seconds`` may be infinite: no bound);
    None: no pass yet."""
    if not passes:
        return None
    tokens = np.array([n for n, _ in passes], dtype=np.float64)
    times = np.array([t for _, t in passes], dtype=np.float64)
    per_token, floor = np.polyfit(tokens, times, 1) if np.ptp(tokens) > 0 else (0.0, 0.0)
    if per_token <= 0 or floor < 0:  # (all alike, or noise: in proportion)
        per_token, floor = times.sum() / tokens.sum(), 0.0
    return int(min(max(seconds - floor, floor) / max(per_token, 1e-9), PROMPT_TOKENS_PER_TURN))


def ride_share(reading: int, rows: int) -> float:
    """The share of the rounds' packed pass over ``rows`` replies that the chunks of the
    ``reading`` prompts read inside it may add: RIDE_SHARE, or where more prompts are read
    than replies decode, that share for each prompt a reply has beside it (seven prompts
    beside one reply: 3.5 passes' worth). A pass's floor (the weights read once) is most of
    its cost, so a reply decoding beside seats full of prompts gains little from short
    passes, while each prompt read adds a row to every later pass: at RIDE_SHARE alone, an
    agent's 330-token turn was read about 8 tokens a pass beside one reply, and 16 agents
    spent a third of their time so (docs/benchmarks.md, "Prompts beside few replies"). With
    as many replies as prompts or more (a long prompt beside replies in progress) it is
    RIDE_SHARE, which bounds their time between tokens."""
    return RIDE_SHARE * max(1.0, reading / rows) if rows else 0.0


@dataclass
class Progress:
    """Prompt tokens read so far of a request's prompt, of ``total``."""

    read: int
    total: int


@dataclass(eq=False)
class ReplyJob:
    """One reply asked for: ``make(slot)`` builds its Generation in its cache slot, on the
    worker; ``out`` is what its caller reads; ``cancel`` stops it (or keeps it from starting).
    ``keep_going``: on a sharded model every rank runs a reply to its end (their collectives
    pair up), so a cancelled one goes on, handing out nothing."""

    ids: List[int]
    make: Callable[[PromptCache], Generation]
    cancel: threading.Event
    keep_going: bool = False
    out: "queue.Queue" = field(default_factory=queue.Queue)
    queued_at: float = field(default_factory=time.monotonic)
    seated_at: Optional[float] = None
    generation: Optional[Generation] = None
    reading: Optional[Iterator[Tuple[int, int]]] = None  # the prompt's reading, until it ends
    read: int = 0
    unread: Optional[int] = None  # prompt tokens still to read (None: not known before its first chunk)
    pace: Optional[float] = None  # prompt tokens a second its last chunk was read at
    ridden: Tuple[float, float] = (0.0, 0.0)  # prompt tokens read inside passes, and seconds they added: decayed
    # The last passes of its own its prompt was read in: (tokens, seconds) each (chunk_for).
    passes: Deque[Tuple[int, float]] = field(default_factory=lambda: deque(maxlen=PASSES_KEPT))

    @property
    def stopped(self) -> bool:
        return self.cancel.is_set() and not self.keep_going


class Scheduler:
    """The worker's loop (``next_job`` for plan.run_jobs): jobs handed in run between turns;
    requests are served in turns as the module says. ``exclusive``: one reply at a time, and
    no job while it runs (a sharded model, whose ranks follow rank 0 step by step).
    ``caches``: the conversations' cache slots (set before the first request: an Engine
    loads its model on this very worker)."""

    def __init__(self, jobs: "queue.Queue", max_concurrency: int, max_queue: int, exclusive: bool = False,
                 caches: Optional[PromptCaches] = None):
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError(f"max_concurrency must be 1 or more and max_queue 0 or more, not "
                             f"{max_concurrency} and {max_queue}")
        self.jobs, self.caches = jobs, caches
        self.max_concurrency = 1 if exclusive else max_concurrency
        self.max_queue, self.exclusive = max_queue, exclusive
        self.waiting: Deque[ReplyJob] = deque()  # on the worker: handed in, not yet seated
        self.live: List[ReplyJob] = []  # seated: reading its prompt or replying
        self.progress_at: Optional[float] = None  # when a reply in progress last moved (None: none in progress)
        # packed passes, the rows they held, prompts' chunks read inside them, rounds alone
        self.stats = {"rounds": 0, "rows": 0, "chunks": 0, "alone": 0}
        self.riding: List[Tuple[ReplyJob, PromptChunk]] = []  # prompts' chunks this turn's packed pass reads
        self.decode_seconds: Optional[float] = None  # a packed pass of rounds alone, smoothed
        self.rode = 0  # packed passes in a row that read a prompt's chunk
        # The pace the last chunk read inside a pass was read at: a new prompt's first chunk is
        # sized at it (its own is not known yet), so that a short prompt rides whole at once.
        self.ride_pace: Optional[float] = None
        self._unseated = 0  # submitted and not yet seated or dropped (any thread)
        self._lock = threading.Lock()
        # Seconds recent replies held their seats, smoothed (what Retry-After is estimated from;
        # None: none has finished yet).
        self._reply_seconds: Optional[float] = None

    # ---- any thread

    def submit(self, request: ReplyJob) -> None:
        """Queue ``request``, or raise Busy when every seat and the queue are taken."""
        with self._lock:
            queued = self._unseated - max(0, self.max_concurrency - len(self.live))
            if queued >= self.max_queue:
                per_reply = REPLY_SECONDS_PRIOR if self._reply_seconds is None else self._reply_seconds
                seconds = per_reply * (queued + 1) / self.max_concurrency  # until a seat is free for it
                raise Busy(f"the server is busy: {len(self.live)} replies in progress and {queued} waiting "
                           f"(--max-concurrency {self.max_concurrency}, --max-queue {self.max_queue}); "
                           "try again shortly", retry_after=min(MAX_RETRY_AFTER, max(1, math.ceil(seconds))))
            self._unseated += 1
        self.jobs.put(request)

    @property
    def queued(self) -> int:
        """Requests submitted and not yet seated."""
        return self._unseated

    def cancel_all(self) -> None:
        """Cancel every reply in progress (not those waiting for a seat)."""
        for request in list(self.live):
            request.cancel.set()

    # ---- the worker

    def next_job(self) -> Optional[Callable[[], Any]]:
        """What the worker runs next: a job handed in, or a turn; None to stop."""
        while True:
            idle = not self.live and not self.waiting
            if self.exclusive and self.live:
                return self.turn
            try:
                item = self.jobs.get(block=idle)
            except queue.Empty:
                return self.turn
            if item is None:
                self._stop()
                return None
            if isinstance(item, ReplyJob):
                self.waiting.append(item)
                continue
            return item

    def run(self) -> None:
        """Serve what was submitted until every request has ended, on this thread, with no
        worker (batch_generate: its jobs are its requests)."""
        while True:
            while not self.jobs.empty():
                self.waiting.append(self.jobs.get())
            if not self.live and not self.waiting:
                return
            self.turn()

    def turn(self) -> None:
        if self.progress_at is None:  # (what /health reads: a turn that never ends is a stall)
            self.progress_at = time.monotonic()
        try:
            for request in [r for r in self.live if r.stopped]:
                self._finish(request)
            # Left while queued: never starts (not even on a sharded model: no rank has begun it).
            for request in [r for r in self.waiting if r.cancel.is_set()]:
                self.waiting.remove(request)
                self._unseat(request)
            self._seat()
            self._read_prompts()
            self._decode()
        except Exception as error:  # a fault of the loop's own: every reply in progress ends with it
            self.riding = []  # (a chunk held for a pass that never ran: its reading ends too)
            for request in list(self.live):
                self._fail(request, error)
        self.progress_at = time.monotonic() if self.live else None

    def _seat(self) -> None:
        deferred = []
        while self.waiting and len(self.live) < self.max_concurrency:
            request = self.waiting.popleft()
            if not request.cancel.is_set() and self._being_read(request):
                deferred.append(request)
                continue
            self._unseat(request)
            if request.cancel.is_set():
                continue
            self.live.append(request)
            request.seated_at = time.monotonic()
            try:
                slot = self.caches.take(request.ids, busy=self._busy_slots())
                request.generation = request.make(slot)
                request.reading = request.generation.read()
            except Exception as error:
                self._fail(request, error)
        self.waiting.extendleft(reversed(deferred))

    def _being_read(self, request: ReplyJob) -> bool:
        """Whether a prompt being read shares a beginning with ``request``'s that the caches
        do not hold yet, of SHARED_READ tokens or more, with at most SHARED_WAIT times that
        left to read (agents started together on one system prompt and tools, sub-agents of
        one client): then ``request`` waits for that reading to end and starts from a copy of
        its caches (PromptCaches.take), instead of reading the same beginning beside it."""
        held = None
        for other in (r for r in self.live if r.reading is not None):
            shared = common_prefix(other.ids, request.ids)
            if shared < SHARED_READ:
                continue
            held = self.caches.held(request.ids) if held is None else held
            left = len(other.ids) if other.unread is None else other.unread
            if shared - held >= SHARED_READ and left <= SHARED_WAIT * (shared - held):
                return True
        return False

    def _unseat(self, request: ReplyJob) -> None:
        """``request`` no longer waits (seated, or dropped: it then never starts)."""
        with self._lock:
            self._unseated -= 1
        if request.cancel.is_set():
            request.out.put(DONE)

    def _busy_slots(self) -> List[PromptCache]:
        return [r.generation.cache for r in self.live if r.generation is not None]

    def _read_prompts(self) -> None:
        """Read new prompts for about PASS_SECONDS a turn (ALONE_PASS_SECONDS where one
        prompt is read with nothing else live or waiting; at most PROMPT_TOKENS_PER_TURN
        tokens), the prompt with the least left to read first, each pass sized to that time
        at the prompt's measured pace: a request that arrives, or a reply in progress, waits
        for at most one such pass of another's long prompt, never for all of it (deep in a
        27k-token prompt a 512-token pass takes over a minute on a slow machine). Where
        replies decode in a packed pass, prompts' chunks are read inside it instead
        (RIDE_PROMPTS, _ride_chunk)."""
        budget = PROMPT_TOKENS_PER_TURN
        reading = [r for r in self.live if r.reading is not None]
        seconds = PASS_SECONDS if len(self.live) > 1 or self.waiting else ALONE_PASS_SECONDS
        rows = sum(batches(r.generation.decoder) for r in self._rows()) if RIDE_PROMPTS else 0
        packed, share = rows > 0, ride_share(len(reading), rows)
        if packed and self.rode >= RIDE_REFRESH:  # rounds alone now and then: their pass's time as it grows
            return
        began, riding = time.perf_counter(), 0.0  # (seconds the chunks held for the pass are to add to it)
        for request in sorted(reading, key=lambda r: len(r.ids) if r.unread is None else r.unread):
            while budget > 0 and not request.stopped:
                decoder = request.generation.decoder
                decoder.rides = packed and batches(decoder) and decoder.kv is None
                if decoder.rides:
                    decoder.read_chunk = min(budget, self._ride_chunk(request, seconds - (time.perf_counter() - began),
                                                                      riding, share))
                    if not decoder.read_chunk:
                        break
                else:
                    sized = chunk_for(seconds, request.passes)
                    decoder.read_chunk = FIRST_CHUNK if sized is None else max(MIN_CHUNK, sized)
                tic = time.perf_counter()
                try:
                    progress = next(request.reading, None)
                except Exception as error:
                    self._fail(request, error)
                    break
                if isinstance(progress, PromptChunk):  # read in this turn's packed pass (_decode)
                    self.riding.append((request, progress))
                    tokens = progress.block.tokens.size
                    pace = self._ride_pace(request)
                    riding += tokens / pace if pace else share * (self.decode_seconds or 0.0)
                    budget -= tokens
                    break
                read = self._took(request, progress, time.perf_counter() - tic, alone=True)
                if read is None:
                    break
                budget -= read
                if time.perf_counter() - began + riding >= seconds:
                    return

    def _ride_pace(self, request: ReplyJob) -> Optional[float]:
        """The pace ``request``'s next chunk inside a pass is read at: its own, or before it has
        one, the last prompt's (``ride_pace``); None: no prompt has ridden yet."""
        return request.pace or self.ride_pace

    def _ride_chunk(self, request: ReplyJob, seconds: float, riding: float, share: float) -> int:
        """The tokens of ``request``'s prompt to read inside this turn's packed pass, beside
        chunks that add ``riding`` seconds to it: as many as add ``share`` of the pass's own
        time, or the whole rest where that adds at most ``seconds`` (a short prompt, or a long
        one's end, read in one pass: its first token comes that much sooner, and the replies
        wait once for it, as long as for a pass of its own); 0: none this turn. A prompt's
        first chunk is sized at the pace the last prompt's chunk rode at (``ride_pace``), its
        whole length taken as its rest (what the caches hold of it is not known yet);
        FIRST_RIDE tokens where no prompt has ridden yet."""
        pace = self._ride_pace(request)
        if pace is None or self.decode_seconds is None:
            return FIRST_RIDE if not riding else 0
        unread = len(request.ids) if request.unread is None else request.unread
        if riding + unread / pace <= seconds:
            return max(unread, MIN_CHUNK)  # (none left: the step that chooses its first token)
        left = share * self.decode_seconds - riding
        return 0 if left <= 0 else max(0 if riding else MIN_CHUNK, int(pace * left))

    def _took(self, request: ReplyJob, progress: Optional[Tuple[int, int]], seconds: float,
              alone: bool = False) -> Optional[int]:
        """A step of ``request``'s reading that took ``seconds`` (``alone``: in a pass of its
        own), handed on: the tokens it read (None: the reading is over, its first token
        handed out)."""
        if progress is None:
            request.reading = None
            self._hand_out(request, request.generation.first())
            return None
        read, total = progress
        if read > request.read:
            request.pace = (read - request.read) / max(seconds, 1e-6)
            if alone:
                request.passes.append((read - request.read, seconds))
        new, request.read, request.unread = read - request.read, read, total - read
        if not request.cancel.is_set():
            request.out.put(Progress(read, total))
        return new

    def _rows(self) -> List[ReplyJob]:
        """The replies decoding (their prompts read)."""
        return [r for r in self.live if r.reading is None and r.generation is not None]

    def _decode(self) -> None:
        rows = self._rows()
        riding, self.riding = self.riding, []
        together = [r for r in rows if batches(r.generation.decoder)] if len(rows) > 1 or riding else []
        tic = time.perf_counter()
        if together:
            try:
                rounds = batched_round([r.generation.decoder for r in together],
                                       [r.generation.room() for r in together], [chunk for _, chunk in riding])
            except Exception as error:  # the shared pass itself failed: every row's reply ends with it
                rounds = [error] * len(together)
                for request, _ in riding:
                    self._fail(request, error)
                riding = []
            self.stats["rounds"] += 1
            self.stats["rows"] += len(together)
            self.stats["chunks"] += len(riding)
            for request, result in zip(together, rounds):
                self._conclude(request, result)
        for request in [r for r in rows if r not in together]:
            self.stats["alone"] += 1
            try:
                result = request.generation.decoder.round(request.generation.room())
            except Exception as error:
                result = error
            self._conclude(request, result)
        seconds = time.perf_counter() - tic
        self.rode = self.rode + 1 if riding else 0
        if rows and not riding:
            self.decode_seconds = seconds if self.decode_seconds is None else 0.7 * self.decode_seconds + 0.3 * seconds
        # A chunk's pace: the tokens read inside passes over what they added to them (each
        # turn's time past the rounds' own, at least a tenth of it), decayed: one pass's excess
        # is as much the rounds' own variation as the chunk's.
        added = max(seconds - (self.decode_seconds or 0.0), 0.1 * seconds)  # (shared by the chunks' tokens)
        riders = sum(chunk.block.tokens.size for _, chunk in riding)
        for request, chunk in riding:
            try:
                progress = next(request.reading, None)
            except Exception as error:
                self._fail(request, error)
                continue
            tokens = chunk.block.tokens.size
            request.ridden = (RIDE_DECAY * request.ridden[0] + tokens,
                              RIDE_DECAY * request.ridden[1] + added * tokens / riders)
            self._took(request, progress, tokens * request.ridden[1] / request.ridden[0])
            self.ride_pace = request.pace or self.ride_pace

    def _conclude(self, request: ReplyJob, result: Any) -> None:
        """A round's result handed to its reply; an error, the round's or the reply's own in
        taking it, ends that reply alone."""
        try:
            if isinstance(result, Exception):
                raise result
            responses = request.generation.conclude(result)
        except Exception as error:
            self._fail(request, error)
            return
        self._hand_out(request, responses)

    def _hand_out(self, request: ReplyJob, responses: Iterator[GenerationResponse]) -> None:
        try:
            for response in responses:
                if not request.cancel.is_set():
                    request.out.put(response)
        except Exception as error:
            self._fail(request, error)
            return
        if request.generation.done:
            self._finish(request)

    def _fail(self, request: ReplyJob, error: Exception) -> None:
        request.out.put(error)
        self._finish(request)

    def _finish(self, request: ReplyJob) -> None:
        """However the reply ended: its slot holds what was handed out, and stays (the
        least recently used others may go)."""
        if request not in self.live:
            return
        self.live.remove(request)
        try:
            if request.generation is not None:
                request.generation.close()
                self.caches.keep(request.generation.cache)
                self.caches.evict(keep=[request.generation.cache, *self._busy_slots()])
        except Exception as error:
            request.out.put(error)
        if request.seated_at is not None:
            seated = time.monotonic() - request.seated_at
            self._reply_seconds = seated if self._reply_seconds is None else 0.7 * self._reply_seconds + 0.3 * seated
        request.out.put(DONE)

    def _stop(self) -> None:
        for request in list(self.live):
            self._finish(request)
        while self.waiting:
            request = self.waiting.popleft()
            request.cancel.set()
            self._unseat(request)


class Reply:
    """What ``Engine.generate`` returns: the reply's responses, as they come, read on the
    caller's thread, which also hears ``on_prompt_read(read, total)`` as the prompt is read
    and ``on_wait()`` every ``KEEPALIVE_SECONDS`` that nothing comes (a queued streamed
    client's keep-alive); an error either raises ends the reply with it. Leaving the loop
    early, ``close()``, or dropping the reply cancels it."""

    def __init__(self, request: ReplyJob, on_prompt_read: Optional[Callable[[int, int], None]] = None,
                 on_wait: Optional[Callable[[], None]] = None):
        self.request, self.on_prompt_read, self.on_wait = request, on_prompt_read, on_wait
        self.finished = False

    def __iter__(self) -> "Reply":
        return self

    def __next__(self) -> GenerationResponse:
        while not self.finished:
            try:
                item = self.request.out.get(timeout=KEEPALIVE_SECONDS if self.on_wait is not None else None)
            except queue.Empty:
                self._hear(self.on_wait)
                continue
            if item is DONE:
                self.finished = True
            elif isinstance(item, Progress):
                if self.on_prompt_read is not None:
                    self._hear(self.on_prompt_read, item.read, item.total)
            elif isinstance(item, BaseException):
                self.close()
                raise item
            else:
                return item
        self.close()
        raise StopIteration

    def _hear(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.request.cancel.set()

    def __del__(self) -> None:
        self.request.cancel.set()


@dataclass
class BatchResponse:
    """What ``batch_generate`` gives, as mlx-lm's does: each prompt's ``texts`` (and token
    ids), ``errors``: what ended a reply early (None: it ended as replies end), and how the
    batch ran: ``forwards``, the packed forward passes and the rounds of conversations served
    alone; ``tokens_per_forward``, the tokens they produced each, all conversations together."""

    texts: List[str]
    token_ids: List[List[int]]
    forwards: int
    tokens_per_forward: float
    errors: List[Optional[Exception]]


def batch_generate(model: nn.Module, tokenizer, prompts: Sequence[Union[str, List[int]]],
                   max_tokens: Union[int, Sequence[int]] = 128, draft: Any = "auto", tree: Any = "auto",
                   lookup: bool = True, history: Any = False, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                   quantized_kv_start: Optional[int] = None, verbose: bool = False, **options: Any) -> BatchResponse:
    """Continue every prompt, as mlx-lm's batch_generate does, with speculation: the
    conversations are served together as the server serves them (``Scheduler``), each
    drafting with drafters of its own, every round verifying the active conversations'
    trees in one forward pass; a conversation leaves the batch when its reply ends, and one
    whose reply fails ends alone (``BatchResponse.errors``). Each text is exactly the one its
    prompt gets alone from stream_generate: the same tokens when greedy, the same
    distribution when sampling (``seed``: the i-th prompt samples with ``seed + i``).
    ``max_tokens``: one bound, or one per prompt; the other arguments, and the reply settings
    in ``options`` (mlx_eagle.options.ReplyOptions), as for stream_generate. A target whose
    rounds cannot share a pass (recurrent layers, latent attention, shards) serves the
    conversations in turn, which ``verbose`` says."""
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts):
        raise UserError(f"max_tokens gives {len(limits)} lengths for {len(prompts)} prompts", "max_tokens")
    shared = ReplyOptions.of(**options)
    rows = [shared.but(max_tokens=limit, seed=None if shared.seed is None else shared.seed + index)
            for index, limit in enumerate(limits)]
    ids = [prompt_ids(tokenizer, prompt) for prompt in prompts]
    for prompt in ids:
        check_prompt(model, prompt)  # before planning, which may time the device
    plan = plan_drafts(model, draft, tree, lookup, history, tokenizer, kv_bits, kv_group_size, quantized_kv_start)
    scheduler = Scheduler(queue.Queue(), max(1, len(prompts)), len(prompts),
                          caches=PromptCaches(model, kv=plan.settings.kv))
    requests = [ReplyJob(prompt, lambda slot, prompt=prompt, row=row: Generation(model, tokenizer, prompt, row, plan,
                                                                                  slot), threading.Event())
                for prompt, row in zip(ids, rows)]
    for request in requests:
        scheduler.submit(request)
    scheduler.run()
    texts, token_ids, errors, produced = [], [], [], 0
    for request in requests:
        pieces, tokens, error, last = [], [], None, None
        while (item := request.out.get_nowait()) is not DONE:
            if isinstance(item, Exception):
                error = item
            elif isinstance(item, GenerationResponse):
                last = item
                pieces.append(item.text)
                tokens += [] if item.token in request.generation.eos else [item.token]
        texts.append("".join(pieces))
        token_ids.append(tokens)
        errors.append(error)
        produced += max(0, last.generation_tokens - 1) if last is not None else 0
    forwards = scheduler.stats["rounds"] + scheduler.stats["alone"]
    response = BatchResponse(texts, token_ids, forwards, produced / forwards if forwards else 0.0, errors)
    if verbose:
        if scheduler.stats["alone"] and len(prompts) > 1 and not scheduler.stats["rounds"]:
            print("batch: this target's rounds cannot share a forward pass here; its conversations are served in "
                  "turn", file=sys.stderr)
        for index, error in enumerate(errors):
            if error is not None:
                print(f"batch: prompt {index}'s reply ended early: {error}", file=sys.stderr)
        print(f"batch: {len(prompts)} prompts, {forwards} forward passes, "
              f"{response.tokens_per_forward:.2f} tokens per forward", file=sys.stderr)
    return response
