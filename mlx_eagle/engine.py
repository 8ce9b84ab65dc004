"""The engine every app and the server serve through: one model and its drafting on a worker
thread of its own, serving concurrent replies together (scheduler.py).

    from mlx_eagle.engine import Engine
    engine = Engine()                              # loads the default model and head once
    for response in engine.generate(ids, max_tokens=64):
        print(response.text, end="", flush=True)

MLX streams belong to the thread that made them, so all model work runs on the one worker
thread the ``Engine`` owns; any thread may submit, iterate and cancel. The engine keeps the
conversations' ``PromptCaches``: a request that continues one reads only its new tokens.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .decoder import rounds_pack
from .distributed import rank, sharded, share_message
from .drafters import Drafter
from .drafters.history import forget_history
from .errors import MAX_CONCURRENCY, MAX_QUEUE, UserError
from .files import cache_dir
from .generation import Generation, GenerationResponse, check_prompt, reply_options, stream_generate
from .models import DEFAULT_MODEL
from .options import DEFAULT_MAX_TOKENS, ReplyOptions
from .plan import DraftPlan, history_of, load_draft, open_target, plan_drafts, run_jobs
from .prompt_cache import PromptCaches, slots_bytes
from .prompt_store import PromptStore
from .replies import ChatResponse, chat_prompt, check_messages, split_reply
from .scheduler import Reply, ReplyJob, Scheduler
from .target import kv_quantization, make_cache
from .thinking import check_budget_alone

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
                 lookup: bool = True, prompt_cache_bytes: Optional[int] = None, prompt_disk_bytes: int = 0,
                 kv_bits: Optional[int] = None,
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
        a request continuing one of them reads only its new tokens. ``prompt_disk_bytes``: what
        long prompts' caches kept on disk (under the cache directory's ``prompts``) may hold, so
        that another engine on this model, in this process or a later one, does not read them
        again (prompt_store.py; 0: none kept; not with a drafter that reads the model's states,
        whose own caches are not kept). ``kv_bits``,
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
        store = self._call(lambda: PromptStore(cache_dir() / "prompts", self.model, kv, prompt_disk_bytes)) \
            if prompt_disk_bytes and self.head is None and not sharded() else None  # (on the worker: it reads weights)
        self.caches = self.scheduler.caches = PromptCaches(self.model, prompt_cache_bytes, kv, store)
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
        prompts, plan, generate, forget caches) until it closes. Call it on the main thread:
        Ctrl-C reaches every rank, each at its own moment, and is rank 0's to answer (the
        server closes, which closes this engine; chat stops showing a reply, which the ranks
        finish together). Ending here on our own would leave rank 0's next collectives
        unpaired, and both ranks waiting."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)

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

    def time_batches(self) -> None:
        """Time this device's packed passes now, where the engine verifies drafted rounds of
        several conversations together and they are not timed yet (once per device and
        target, kept on disk; on a CPU up to about 20 s): else the first round of several
        conversations times them, every client waiting (the server calls this before serving)."""
        def measure() -> None:
            plan = self.plan() if self.batches else None  # (never sharded: no collective to pair)
            if plan is not None and plan.active:
                plan.settings.costs.measure_packed()

        self._call(measure)

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
        options = reply_options(options, keywords.pop("max_tokens", DEFAULT_MAX_TOKENS), keywords)
        check_prompt(self.model, ids)  # before planning, which may time this device
        check_budget_alone(self.tokenizer, options.thinking_budget, options.response_format)
        cancel = cancel if cancel is not None else threading.Event()
        self._cancels.add(cancel)

        def make(slot) -> Generation:  # on the worker, when the request is seated
            self._announce("generate", ids, asdict(options), getattr(tree, "text", tree), history_key)
            return Generation(self.model, self.tokenizer, ids, options, self.plan(tree, history_key), slot)

        request = ReplyJob(list(ids), make, cancel, keep_going=bool(self.shards))
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
