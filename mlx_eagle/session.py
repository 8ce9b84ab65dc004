"""Chat sessions for desktop tools, the chat app and the server.

    from mlx_eagle.session import ChatSession
    chat = ChatSession()                      # loads the default model and head once
    for chunk in chat.send("Hi! Who are you?"):
        print(chunk.text, end="", flush=True)
    chat.cancel()                             # from any thread: stops within one round

MLX streams belong to the thread that made them, so all model work runs on one worker
thread that the ``Engine`` owns; any thread may submit, iterate and cancel. The engine
keeps one ``PromptCache``: a turn that extends the last conversation reads only its
new tokens.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .prompt_cache import PromptCaches, slots_bytes
from .distributed import rank, share_message, sharded
from .drafters import Drafter
from .errors import MAX_CONCURRENCY, MAX_QUEUE, UserError
from .generation import Generation, GenerationResponse, check_prompt, stream_generate
from .options import ReplyOptions
from .models import DEFAULT_MODEL
from .drafters.history import forget_history
from .plan import DraftPlan, history_of, load_draft, open_target, plan_drafts, run_jobs
from .scheduler import Reply, Request, Scheduler
from .replies import ChatResponse, ReplySplitter, chat_prompt, check_messages, check_tool_support, check_tools, \
    split_reply
from .decoder import rounds_pack
from .target import kv_quantization, make_cache
from .thinking import check_budget_alone

Message = Dict[str, Any]


STOP_SECONDS = 5.0  # how long close() waits for the generation in progress to stop
MAX_PLANS = 16  # draft plans kept (one per tree and history key: a server's requested model ids), least recent out


def _stop_worker(jobs: "queue.Queue", thread: threading.Thread, wait: Optional[float] = STOP_SECONDS) -> None:
    """Ask the worker to end after its current job, and give it ``wait`` seconds (a model or
    drafter call that never returns must not hold the process: the thread is a daemon)."""
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join(wait)


class Engine:
    """One model and head on their own worker thread, serving up to ``max_concurrency``
    replies at once, their rounds verified together in one forward pass (scheduler.py);
    others wait for a seat in a queue of at most ``max_queue``."""

    def __init__(self, model: Optional[str] = None, draft: Union[str, Drafter, type, None] = "auto",
                 loaded: Optional[tuple] = None, name: Optional[str] = None, tree: Any = "auto", history: Any = True,
                 lookup: bool = True, prompt_cache_bytes: Optional[int] = None, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64, quantized_kv_start: Optional[int] = None, pipeline: bool = False,
                 max_concurrency: int = MAX_CONCURRENCY, max_queue: int = MAX_QUEUE,
                 escape_special_text: bool = False):
        """``draft``: a drafter's directory, "auto" (the model's own drafter, if any),
        "lookup" (drafts from the context alone), "none" (plain decoding), or your own
        drafter: a ``Drafter`` object or class, or "package.module:Name" (fresh for every
        conversation); every choice but "none" also drafts from the context unless
        ``lookup`` is False (see plan.py). ``loaded``: (model,
        tokenizer, drafter weights or None) already in memory,
        instead of loading ``model`` and ``draft``; ``name``: what to call the model
        (default: its directory's); ``tree``: the head's tree when a generation names none;
        ``history``: the earlier replies context drafts draft from (True: this engine's, in
        memory; a path: kept in that file; False: none), kept apart per history key.
        ``prompt_cache_bytes``: what the caches of the conversations kept (prompt_cache.PromptCaches)
        may hold (None: sized from the model and this machine's memory, prompt_cache.default_cache_bytes);
        a request continuing one of them reads only its new tokens. ``kv_bits``,
        ``kv_group_size``, ``quantized_kv_start``: every conversation's KV caches quantized, as
        mlx-lm's settings ask (target.KVQuantization). ``max_concurrency``: replies in
        progress at once; ``max_queue``: requests waiting for a seat, past which ``generate``
        raises errors.Busy. Under mlx.launch the model is sharded (by layers with
        ``pipeline``; one reply at a time): rank 0's engine is the one to use, and every
        other rank's runs ``follow``. ``escape_special_text``: special tokens' text typed in a
        chat message stays text (replies.chat_tokens' ``literal``), for engines that serve
        untrusted users."""
        self.escape_special_text = escape_special_text
        kv = kv_quantization(kv_bits, kv_group_size, quantized_kv_start)  # one line, before anything loads
        self.kv_options = {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "quantized_kv_start": quantized_kv_start}
        self._jobs: "queue.Queue" = queue.Queue()
        self._closed = False
        self._cancels: "weakref.WeakSet[threading.Event]" = weakref.WeakSet()  # every generation asked for
        # The worker's loop; it holds no reference to the engine, so that an engine dropped
        # without close() is collected, which stops the worker.
        self.scheduler = Scheduler(self._jobs, max_concurrency, max_queue, exclusive=sharded())
        self._worker = worker = threading.Thread(target=run_jobs, args=(self.scheduler.next_job,),
                                                 name="mlx-eagle-engine", daemon=True)
        worker.start()
        # also when the engine is collected, or at exit without close()
        self._stop = weakref.finalize(self, _stop_worker, self._jobs, worker)
        if loaded is None:
            loaded = self._call(lambda: self._load(model, draft, pipeline))
        else:  # a lazy array can only be evaluated on the thread whose stream made it
            mx.eval([m.parameters() for m in loaded if hasattr(m, "parameters")])
        self.model, self.tokenizer, self.head, *path = loaded
        self.lookup = lookup and draft != "none"
        self.name = name or (path[0].name if path else DEFAULT_MODEL)
        self._plans: "OrderedDict[Any, DraftPlan]" = OrderedDict()
        self.tree, self.history = tree, history
        self.caches = self.scheduler.caches = PromptCaches(self.model, prompt_cache_bytes, kv)
        # A sharded model: rank 0 tells the other ranks' engines what it does that runs the
        # model (their collectives must pair with its own), and they do the same (follow).
        self.shards = sharded()

    @staticmethod
    def _load(model: Optional[str], draft: Optional[str], pipeline: bool = False):
        target, tokenizer, path = open_target(model, pipeline=pipeline)
        return target, tokenizer, load_draft(draft, target), path

    def _announce(self, *step: Any) -> None:
        """On rank 0 of a sharded model, on the worker: send ``step`` to the followers."""
        if self.shards and rank() == 0:
            share_message(list(step))

    def follow(self) -> None:
        """On a rank other than 0 of a sharded model: do what rank 0's engine does (read
        prompts, plan, generate, forget caches) until it closes."""
        def job() -> None:
            while True:
                step, *args = share_message(None)
                if step == "close":
                    return
                try:
                    if step == "generate":
                        ids, options, tree, history_key = args
                        for _ in self._generation(ids, ReplyOptions(**options), tree, history_key):
                            pass
                    elif step == "plan":
                        self.plan(*args)
                    elif step == "reset_cache":
                        self.caches.slots.clear()
                except UserError:  # rank 0 met it too, and answers it
                    pass

        self._call(job)

    def _generation(self, ids: List[int], options: ReplyOptions, tree: Any,
                    history_key: str) -> Iterator[GenerationResponse]:
        """A follower's generation in its conversation's cache slot (on the worker), as rank
        0's scheduler runs it: one at a time, the same slot, plan and rounds."""
        cache = self.caches.take(ids)
        try:
            yield from stream_generate(self.model, self.tokenizer, ids, draft=self.plan(tree, history_key),
                                       prompt_cache=cache, options=options, **self.kv_options)
        finally:
            self.caches.evict(keep=[cache])

    def plan(self, tree: Any = None, history_key: str = "") -> DraftPlan:
        """What drafts with ``tree`` (a --tree spec; None: the engine's), drafting from the
        history kept for ``history_key`` (the server's requested model id): planned once per
        pair, on the worker thread (planning may time this device's forwards)."""
        tree = self.tree if tree is None else tree
        key = (getattr(tree, "text", tree), history_key)
        if key not in self._plans:
            history = history_of(self.model, self.history, history_key) if self.lookup else None
            self._plans[key] = plan_drafts(self.model, self.head, tree, self.lookup, history, self.tokenizer,
                                           **self.kv_options)
            while len(self._plans) > MAX_PLANS:  # every request may name another model id: bounded
                (_, dropped), _ = self._plans.popitem(last=False)
                if self.history is True and not any(kept == dropped for _, kept in self._plans):
                    forget_history(self.model, dropped)
        self._plans.move_to_end(key)
        return self._plans[key]

    def clear_history(self) -> None:
        """Forget the earlier replies every plan drafts from (and empty their files)."""
        self._call(lambda: [p.settings.history.clear() for p in self._plans.values() if p.settings.history])

    def _call(self, function: Callable[[], Any]) -> Any:
        """Run ``function`` on the worker and return its result (or raise its error)."""
        self._check_open()
        box: "queue.Queue" = queue.Queue()

        def job():
            try:
                box.put((True, function()))
            except BaseException as exc:  # handed to the caller
                box.put((False, exc))

        self._jobs.put(job)
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def _check_open(self) -> None:
        if self._closed:  # its worker is gone: a job would wait for ever
            raise RuntimeError("this engine is closed; make a new Engine")

    @property
    def drafting(self) -> str:
        """What drafts each round with the engine's tree, in words."""
        def describe() -> str:
            self._announce("plan", getattr(self.tree, "text", self.tree), "")
            return self.plan().describe()

        return self._call(describe)

    @property
    def drafting_off(self) -> List[str]:
        """The drafters that do not draft for this model, and why (empty: none is off)."""
        return self._call(lambda: self.plan().off)

    @property
    def batches(self) -> bool:
        """Whether concurrent replies share forward passes (else each turn they take their
        rounds one after another: a hybrid's recurrent layers, latent attention, shards)."""
        return rounds_pack(self.model, make_cache(self.model), self.shards) and self.scheduler.max_concurrency > 1

    @property
    def context_length(self) -> Optional[int]:
        return getattr(self.model.args, "max_position_embeddings", None)

    def generate(self, ids: List[int], options: Optional[ReplyOptions] = None, *,
                 cancel: Optional[threading.Event] = None, on_prompt_read: Optional[Callable[[int, int], None]] = None,
                 on_wait: Optional[Callable[[], None]] = None, tree: Any = None, history_key: str = "",
                 **keywords: Any) -> Reply:
        """Stream the continuation of ``ids``, with the reply's settings ``options`` (or as
        keywords: mlx_eagle.options.ReplyOptions), the head's ``tree`` (None: the engine's)
        and the earlier replies kept for ``history_key`` (the server's model id). The
        request is queued at once (errors.Busy: no seat and the queue full), and served
        alongside the others in progress (scheduler.py). Leaving the loop early, setting
        ``cancel`` (also before it starts: it then never runs) or ``Engine.cancel()`` stops
        the generation within a round, or between two chunks of a long prompt (on a sharded
        model, whose ranks end a reply together, it stops handing it out). While iterating,
        the caller's thread hears ``on_prompt_read(read, total)`` after each chunk of the
        prompt and ``on_wait()`` every few seconds that nothing comes (waiting for a seat);
        an error either raises ends the generation with that error."""
        self._check_open()
        options = options if options is not None else ReplyOptions(**keywords)
        check_prompt(self.model, ids)  # before planning, which may time this device
        check_budget_alone(self.tokenizer, options.thinking_budget, options.response_format)
        cancel = cancel if cancel is not None else threading.Event()
        self._cancels.add(cancel)

        def make(slot) -> Generation:  # on the worker, when the request is seated
            self._announce("generate", ids, asdict(options), getattr(tree, "text", tree), history_key)
            return Generation(self.model, self.tokenizer, ids, options, self.plan(tree, history_key), slot)

        request = Request(list(ids), make, cancel, keep_going=bool(self.shards))
        self.scheduler.submit(request)
        return Reply(request, on_prompt_read, on_wait)

    def chat(self, messages: Sequence[Dict[str, Any]], tools: Optional[Sequence[Dict[str, Any]]] = None,
             tool_choice: Any = None, cancel: Optional[threading.Event] = None,
             **options) -> Iterator[ChatResponse]:
        """Stream the assistant's reply to ``messages`` (OpenAI's shapes: tool calls and tool
        results included), offering ``tools`` (OpenAI's function tools; ``tool_choice``
        "auto", "none", "required" or a named function). Each piece's ``text`` is answer
        text, ``reasoning`` the model's thinking and ``tool_calls`` the calls it finished
        (replies.py); a reply that made calls finishes with "tool_calls". Options as for
        ``generate``."""
        ids, splitter = chat_prompt(self.tokenizer, check_messages(messages), tools, tool_choice,
                                    literal=self.escape_special_text)
        if splitter.forced_call:  # the reply is a tool call: response_format is for answer text
            options.pop("response_format", None)
        return split_reply(self.generate(ids, cancel=cancel, **options), splitter)

    def stalled_for(self) -> float:
        """Seconds the replies in progress have gone without progress (0: none in progress)."""
        since = self.scheduler.progress_at
        return time.monotonic() - since if since is not None else 0.0

    @property
    def in_progress(self) -> int:
        """Replies in progress (reading their prompts or replying)."""
        return len(self.scheduler.live)

    @property
    def waiting(self) -> int:
        """Requests waiting for a seat."""
        return self.scheduler.queued

    @property
    def cache_bytes(self) -> int:
        """What the conversations' kept caches hold, in bytes."""
        return slots_bytes(list(self.caches.slots))

    def cancel(self) -> None:
        """Stop every reply in progress, whoever asked for it (safe from any thread);
        requests waiting for a seat still start."""
        self.scheduler.cancel_all()

    def reset_cache(self) -> None:
        """Forget every conversation's cache."""
        def reset() -> None:
            self._announce("reset_cache")
            self.caches.slots.clear()

        self._call(reset)

    def close(self, wait: float = STOP_SECONDS) -> bool:
        """Stop the generation in progress and the worker, giving it ``wait`` seconds; later
        calls raise RuntimeError; generations still waiting their turn never start. False:
        the worker is still stuck in a call (a model or drafter call that never returns),
        left behind as a daemon thread."""
        for cancel in list(self._cancels):
            cancel.set()
        if not self._closed and self.shards:
            self._call(lambda: self._announce("close"))
        self._closed = True
        self._stop.detach()
        _stop_worker(self._jobs, self._worker, wait)
        return not self._worker.is_alive()


@dataclass
class TurnStats:
    """What the last reply cost: tokens, speed, tau and the prompt tokens read vs reused."""

    tokens: int
    tokens_per_s: float
    tau: float
    prompt_tokens: int
    prompt_reused: int
    prompt_seconds: float  # reading the part of the prompt the cache did not hold
    finish_reason: Optional[str]

    def line(self) -> str:
        # The first token comes from reading the prompt: a speed needs a second one.
        tokens = (f"{self.tokens} tokens, {self.tokens_per_s:.1f} tokens/s" if self.tokens > 1
                  else f"{self.tokens} token")
        return (f"{tokens}, tau {self.tau:.2f}, "
                f"prompt {self.prompt_tokens - self.prompt_reused} read + {self.prompt_reused} cached "
                f"in {self.prompt_seconds:.2f} s")


class ChatSession:
    """A conversation with one model: ``send`` streams replies, the history is plain
    data (``history``, assignable), ``cancel`` stops a reply from any thread, ``reset``
    forgets. Oldest turns are dropped (with a notice) once the history outgrows the
    context window."""

    def __init__(self, model: Optional[str] = None, draft: Union[str, Drafter, type, None] = "auto", *,
                 system: Optional[str] = None, tree: str = "auto", temp: float = 0.0, top_p: float = 1.0,
                 max_tokens: int = 512, seed: Optional[int] = None, engine: Optional[Engine] = None,
                 history: Any = True, lookup: bool = True, tools: Optional[Sequence[Dict[str, Any]]] = None,
                 on_notice: Callable[[str], None] = lambda text: None, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64, quantized_kv_start: Optional[int] = None, pipeline: bool = False):
        """``draft``, ``tree``, ``history`` and ``lookup`` as for ``Engine`` (or share one:
        ``engine``), and ``kv_bits``, ``kv_group_size``, ``quantized_kv_start`` and ``pipeline``; your own drafter
        drafts afresh for this conversation. ``tools``: the
        function tools (OpenAI's shape) the model may call: a reply's ``tool_calls``,
        answered with ``send_tool_results``."""
        self.tools = check_tools(tools) if tools else []
        self.engine = engine or Engine(model, draft, tree=tree, history=history, lookup=lookup, kv_bits=kv_bits,
                                       kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                                       pipeline=pipeline)
        if self.tools:
            check_tool_support(self.engine.tokenizer)
        self.system, self.tree, self.on_notice = system, tree, on_notice
        self.options = ReplyOptions(max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed)
        self.stats: Optional[TurnStats] = None
        self._history: List[Message] = []
        # Re-entrant: a reply suspended in this very thread (its generator not yet exhausted)
        # holds it, and reset() from the same thread must not wait for it for ever.
        self._busy = threading.RLock()
        self._epoch = 0  # bumped by reset(): a reply begun before it does not join the new history
        # One per reply asked for and not yet finished: set, it stops or never starts. Weak:
        # a reply that is never iterated leaves nothing behind.
        self._cancels: "weakref.WeakSet[threading.Event]" = weakref.WeakSet()

    @property
    def history(self) -> List[Message]:
        """The conversation so far (user and assistant turns), as plain data."""
        return [dict(m) for m in self._history]

    @history.setter
    def history(self, messages: List[Message]) -> None:
        messages = check_messages(messages, "history", allow_empty=True)
        if messages and messages[0]["role"] == "system":
            self.system, messages = messages[0]["content"], messages[1:]
        if any(m["role"] == "system" for m in messages):
            raise UserError("only the first message may be a system prompt")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a reply is in progress; cancel it before replacing the history")
        self._history = messages
        self._busy.release()

    def messages(self, extra: Sequence[Message] = ()) -> List[Message]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self._history + list(extra)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays); a reply in progress on
        another thread is cancelled first."""
        self.cancel()
        with self._busy:
            self._history = []
            self._epoch += 1

    def cancel(self) -> None:
        """Stop this session's reply (another session's on the same engine runs on)."""
        for cancel in list(self._cancels):
            cancel.set()

    def _fit(self, new: List[Message]) -> Tuple[List[int], ReplySplitter]:
        """The prompt for the history plus the ``new`` messages, dropping the oldest turns
        while it leaves less than ``max_tokens`` of the context for the reply."""
        tokenizer, limit = self.engine.tokenizer, self.engine.context_length
        ids, splitter = chat_prompt(tokenizer, self.messages(new), self.tools)
        dropped = 0
        while limit is not None and len(ids) + self.options.max_tokens > limit and self._history:
            # A turn is a user message and what follows it (replies, tool calls and results).
            cut = next((i for i in range(1, len(self._history)) if self._history[i]["role"] == "user"),
                       len(self._history))
            self._history = self._history[cut:]
            dropped += 1
            ids, splitter = chat_prompt(tokenizer, self.messages(new), self.tools)
        if dropped:
            self.on_notice(f"the conversation outgrew the {limit}-token context: dropped the oldest "
                           f"{dropped} turn{'s' if dropped > 1 else ''}")
        if limit is not None and len(ids) >= limit:
            raise UserError(f"the message is {len(ids)} tokens with the chat template; the model's context "
                            f"holds {limit}. Shorten it")
        return ids, splitter

    def send(self, text: str) -> Iterator[ChatResponse]:
        """Stream the reply to ``text``. What was shown stays in the history, a cancelled
        reply included; a reply cancelled before its first token leaves no turn. A
        ``cancel()`` from the moment this is called stops it."""
        return self._start([{"role": "user", "content": text}])

    def send_tool_results(self, results: Dict[str, str]) -> Iterator[ChatResponse]:
        """Stream the reply after the tools' ``results`` ({call id: what the tool returned})
        for the calls of the last reply."""
        if not isinstance(results, dict) or not results:
            raise UserError("results must be a non-empty {tool call id: result text} dict")
        return self._start([{"role": "tool", "tool_call_id": call, "content": content}
                            for call, content in results.items()])

    def _start(self, new: List[Message]) -> Iterator[ChatResponse]:
        cancel = threading.Event()
        self._cancels.add(cancel)
        return self._reply(new, cancel)

    def _reply(self, new: List[Message], cancel: threading.Event) -> Iterator[ChatResponse]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a reply is already in progress; cancel it or wait for it")
        try:
            epoch = self._epoch
            new = check_messages(self.messages(new), "message")[len(self.messages()):]
            ids, splitter = self._fit(new)
            reply, calls, last = "", [], None
            try:
                for last in split_reply(self.engine.generate(ids, self.options, cancel=cancel, tree=self.tree),
                                        splitter):
                    reply += last.text
                    calls += last.tool_calls
                    yield last
            finally:
                if last is not None and epoch == self._epoch:
                    answer: Message = {"role": "assistant", "content": reply}
                    if calls:
                        answer["tool_calls"] = [call.openai() for call in calls]
                    self._history += new + check_messages([answer], "reply")
                    self.stats = TurnStats(
                        tokens=last.generation_tokens, tokens_per_s=last.generation_tps, tau=last.tokens_per_forward,
                        prompt_tokens=last.prompt_tokens, prompt_reused=last.prompt_reused,
                        prompt_seconds=(last.prompt_tokens - last.prompt_reused) / max(last.prompt_tps, 1e-9),
                        finish_reason=last.finish_reason or "cancelled")
        finally:
            self._busy.release()

    def send_in_background(self, text: str, on_chunk: Callable[[ChatResponse], None],
                           on_done: Callable[[Optional[BaseException]], None] = lambda error: None) -> threading.Thread:
        """For GUIs: stream the reply on a thread of its own, calling ``on_chunk`` for
        each piece and ``on_done`` at the end (with the error, if any). The callbacks run
        on that thread; hand their results to your toolkit's main loop."""

        replies = self.send(text)  # so that a cancel() right after this returns is not lost

        def run():
            try:
                for chunk in replies:
                    on_chunk(chunk)
            except BaseException as exc:
                on_done(exc)
            else:
                on_done(None)

        thread = threading.Thread(target=run, name="mlx-eagle-reply", daemon=True)
        thread.start()
        return thread
