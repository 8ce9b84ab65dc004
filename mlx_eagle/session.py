"""Chat sessions for desktop tools and the chat app, on an ``Engine`` (engine.py).

    from mlx_eagle.session import ChatSession
    chat = ChatSession()                      # loads the default model and head once
    for chunk in chat.send("Hi! Who are you?"):
        print(chunk.text, end="", flush=True)
    chat.cancel()                             # from any thread: stops within one round

A turn that extends the conversation reads only its new tokens (the engine keeps its cache).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from .drafters import Drafter
from .engine import Engine
from .errors import UserError
from .options import ReplyOptions
from .replies import ChatResponse, ReplySplitter, chat_prompt, check_messages, check_tool_support, check_tools, \
    split_reply

Message = Dict[str, Any]


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
