"""OpenAI's chat completions (``POST /v1/chat/completions``) and completions (``POST
/v1/completions``; a completion with a ``suffix`` fills in the middle, infill.py), as the
``openai`` SDK and the clients built on it speak them.

Fields the server does not implement (penalties, ``logit_bias``) get a 400 naming the field,
unless they ask for what it does anyway. ``response_format`` (``json_object``,
``json_schema``) holds the reply to its grammar (grammar.py), drafting still on.
``logprobs`` (and ``top_logprobs`` up to 20) are the target's own, from the pass that chose
each token. Thinking budgets (``thinking_budget``, ``reasoning_effort``) hold inside
speculation (thinking.py). Chat replies come back split (replies.py): the model's thinking as
``reasoning_content``, its tool calls as ``tool_calls`` (``finish_reason: "tool_calls"``),
streamed as deltas the way OpenAI streams them (each call whole, in one delta); a streamed
reply ends with ``data: [DONE]``, and one cut off ends with an error event and no [DONE].
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import check_text
from ..infill import infill_prompt
from ..thinking import check_budget, effort_budget
from ..options import ReplyOptions
from . import Collected, Protocol, Request, RequestError, flag, number, texts, whole
from .chat import chat_ids

# OpenAI fields this server does not implement, and the values that ask for nothing it lacks:
# such a field with another value is refused (400 naming it), as other servers do, rather
# than silently ignored.
UNSUPPORTED = {
    "functions": lambda v: v in (None, []),  # the older names of tools and tool_choice: send those
    "function_call": lambda v: v in (None, "none", "auto"),
    "frequency_penalty": lambda v: v in (None, 0),
    "presence_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: v in (None, {}),
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
}
MAX_TOP_LOGPROBS = 20


class Completions(Protocol):
    """OpenAI's completions: a text (or token ids) continued."""

    chat = False
    kind, chunk_kind, id_prefix = "text_completion", "text_completion", "cmpl"

    def parse(self, body: Any, engine, default_max_tokens: int) -> Request:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        for name, asks_nothing in UNSUPPORTED.items():
            if name in body and not _is_harmless(asks_nothing, body[name]):
                raise RequestError(400, f"{name} is not supported by this server; leave it out", name,
                                   "unsupported_field")
        limit = engine.context_length or 1 << 30
        ids, splitter, ends = self._prompt(body, engine)
        vocab = engine.model.args.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(400, f"prompt token ids must lie in 0..{vocab - 1}", "prompt")
        if len(ids) >= limit:
            raise RequestError(400, f"the prompt is {len(ids)} tokens; the model's context holds {limit}",
                               "messages" if self.chat else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        if body.get("n", 1) not in (None, 1):
            raise RequestError(400, "only n=1 is supported", "n")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError(400, "stream_options must be an object", "stream_options")
        top_logprobs = self._logprobs(body)
        # (A reply made to begin with a tool call is that call: response_format is for answer text.)
        response_format = None if splitter is not None and splitter.forced_call else body.get("response_format")
        options = ReplyOptions(max_tokens=whole(body, name, 1, limit, default=default_max_tokens),
                                temp=number(body, "temperature", 0.0, 0.0, 2.0),
                                top_p=number(body, "top_p", 1.0, 0.0, 1.0), seed=body.get("seed"),
                                stop=texts(body, "stop", 4), logprobs=top_logprobs is not None,
                                response_format=response_format, thinking_budget=_thinking_budget(body),
                                stop_tokens=ends)
        model = body.get("model")
        return Request(ids=ids, chat=self.chat, stream=flag(body, "stream"), options=options,
                       model=model if isinstance(model, str) else "", splitter=splitter, protocol=self,
                       echo={"model": engine.name, "include_usage": bool(stream_options.get("include_usage")),
                             "top_logprobs": top_logprobs, "tokenizer": engine.tokenizer})

    def _prompt(self, body: dict, engine) -> Tuple[List[int], Any, Tuple[int, ...]]:
        """A completion's prompt: its text or token ids; with a ``suffix``, the model's
        fill-in-the-middle prompt for what goes between the two (infill.py), and the tokens
        that end the middle."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise RequestError(400, "suffix must be a string: the text after the insertion point", "suffix")
        if suffix:
            if not isinstance(prompt, str):
                raise RequestError(400, "with a suffix, prompt must be a string: the text before the insertion "
                                        "point", "prompt")
            infill = infill_prompt(engine.tokenizer, check_text(prompt, "prompt"), check_text(suffix, "suffix"))
            return infill.ids, None, infill.stop_tokens
        if isinstance(prompt, str) and prompt:
            return engine.tokenizer.encode(check_text(prompt, "prompt")), None, ()
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return list(prompt), None, ()
        raise RequestError(400, "prompt must be a non-empty string (or one list of token ids)", "prompt")

    def _logprobs(self, body: dict) -> Optional[int]:
        """How many alternatives to report beside each chosen token's log-probability (None:
        none asked for): completions' ``logprobs``, 0-5."""
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 5:
            raise RequestError(400, "logprobs must be an integer from 0 to 5", "logprobs")
        return value

    def error(self, error: RequestError) -> Dict[str, Any]:
        kind = "server_error" if error.status >= 500 else "invalid_request_error"
        return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}

    def stream_error(self, error: RequestError) -> bytes:
        return f"data: {json.dumps(self.error(error))}\n\n".encode()

    def keepalive(self, request: Request, to_read: Optional[int] = None) -> bytes:
        # An SSE comment (clients skip it); its write finds a client that has gone.
        return b": waiting for a seat\n\n" if to_read is None else b": reading the prompt\n\n"

    def collect(self, request: Request, collected: Collected, piece: Any) -> None:
        collected.add(piece)
        if request.echo["top_logprobs"] is not None:
            collected.logprobs.append(self._entry(request, piece))

    def _entry(self, request: Request, response: Any) -> Dict[str, Any]:
        """One token's entry in OpenAI's ``logprobs.content``: its text, bytes and
        log-probability, and the request's ``top_logprobs`` most likely tokens at its position."""
        top, tokenizer = request.echo["top_logprobs"], request.echo["tokenizer"]

        def entry(token: int, logprob: float) -> Dict[str, Any]:
            text = tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        values = np.array(response.logprobs)  # evaluated on the engine's thread; read here on the host
        result = entry(response.token, float(values[response.token]))
        best = np.argpartition(-values, top - 1)[:top] if top else []
        result["top_logprobs"] = [entry(int(token), float(values[token]))  # (none a grammar refused: -inf)
                                  for token in sorted(best, key=lambda token: -values[token])
                                  if values[token] > -np.inf]
        return result

    def _envelope(self, request: Request, kind: str) -> Dict[str, Any]:
        return {"id": f"{self.id_prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": request.echo["model"]}

    def _logprobs_field(self, entries: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The legacy completions shape of the entries."""
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def _choice(self, request: Request, text: str, finish: Optional[str], entries: List[Dict[str, Any]],
                **_: Any) -> Dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": finish,
                "logprobs": self._logprobs_field(entries) if request.echo["top_logprobs"] is not None else None}

    def reply(self, request: Request, collected: Collected, usage: Dict[str, Any]) -> Dict[str, Any]:
        choice = self._choice(request, collected.text, collected.last.finish_reason, collected.logprobs,
                              reasoning=collected.reasoning, calls=collected.calls, whole=True)
        return {**self._envelope(request, self.kind), "choices": [choice], "usage": usage}

    def events(self, request: Request, responses: Iterator[Any],
               usage: Callable[[Any], Dict[str, Any]]) -> Iterator[bytes]:
        envelope = self._envelope(request, self.chunk_kind)

        def event(choice: Optional[Dict[str, Any]], **extra: Any) -> bytes:
            chunk = dict(envelope, choices=[choice] if choice is not None else [], **extra)
            return f"data: {json.dumps(chunk)}\n\n".encode()

        yield from (event(choice) for choice in self._opening())
        last, calls = None, 0
        for last in responses:
            entries = [self._entry(request, last)] if request.echo["top_logprobs"] is not None else []
            yield event(self._choice(request, last.text, last.finish_reason, entries,
                                     reasoning=getattr(last, "reasoning", ""),
                                     calls=getattr(last, "tool_calls", []), first_call=calls))
            calls += len(getattr(last, "tool_calls", []))
        if last is None or last.finish_reason is None:
            return  # cut off: the server says so in its own error event, and there is no [DONE]
        if request.echo["include_usage"]:
            yield event(None, usage=usage(last))
        yield b"data: [DONE]\n\n"

    def _opening(self) -> List[Dict[str, Any]]:
        return []


class ChatCompletions(Completions):
    """OpenAI's chat completions: a conversation (tools and tool results included) answered."""

    chat = True
    kind, chunk_kind, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def _prompt(self, body: dict, engine) -> Tuple[List[int], Any, Tuple[int, ...]]:
        ids, splitter = chat_ids(engine, body.get("messages"), body.get("tools"), body.get("tool_choice"))
        return ids, splitter, ()

    def _logprobs(self, body: dict) -> Optional[int]:
        """Chat's ``logprobs`` true, with ``top_logprobs`` 0-20."""
        value, top = body.get("logprobs"), body.get("top_logprobs")
        if value is not None and not isinstance(value, bool):
            raise RequestError(400, "logprobs must be true or false", "logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise RequestError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
        if top and not value:
            raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if value else None

    def _choice(self, request: Request, text: str, finish: Optional[str], entries: List[Dict[str, Any]],
                reasoning: str = "", calls: List[Any] = (), first_call: int = 0,
                whole: bool = False) -> Dict[str, Any]:
        logprobs = {"content": entries} if request.echo["top_logprobs"] is not None else None
        if whole:
            message: Dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
            return {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
        delta: Dict[str, Any] = {"content": text} if text else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = [call.openai(first_call + i) for i, call in enumerate(calls)]
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

    def _opening(self) -> List[Dict[str, Any]]:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]


def _thinking_budget(body: dict) -> Optional[int]:
    """A chat completion's thinking budget: ``thinking_budget`` (tokens), else the one
    ``reasoning_effort`` names (thinking.EFFORT_BUDGETS)."""
    if body.get("thinking_budget") is not None:
        return check_budget(body["thinking_budget"])
    return effort_budget(body.get("reasoning_effort"), "reasoning_effort")


def _is_harmless(asks_nothing, value: Any) -> bool:
    try:
        return bool(asks_nothing(value))
    except TypeError:  # an unhashable value where a scalar was expected
        return False
