"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``,
as the ``anthropic`` SDK (and Claude Code) speaks it.

A request's ``system`` and ``messages`` (content blocks ``text``, ``tool_use``,
``tool_result``; earlier ``thinking`` blocks are left out, as reasoning models' templates
leave out earlier thinking), its ``tools`` (``input_schema``) and ``tool_choice`` (``auto``,
``any``, ``tool``, ``none``) become the conversation in OpenAI's shapes that chat
completions reads, so the same conversation is the same prompt through either. Any model
name is accepted (a ``claude-*`` name too): the server answers with the model it loaded.
``thinking`` (``{"type": "enabled", "budget_tokens": N}``) opens a reasoning model's
thinking, ended after N tokens inside speculation (thinking.py); it is answered with
``thinking`` blocks; ``output_config`` takes an ``effort`` (a budget for adaptive thinking:
thinking.EFFORT_BUDGETS) and a JSON schema ``format`` (grammar.py). ``temperature``,
``top_p`` and ``top_k`` are read where a client still sends them (greedy by default, as
this server's other routes). Streamed, the reply is Anthropic's events: ``message_start``, a
``ping``, then per block ``content_block_start``, ``content_block_delta`` (``text_delta``,
``thinking_delta``, ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (stop reason, usage) and ``message_stop``.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import UserError, check_text
from ..grammar import response_grammar
from ..options import ReplyOptions
from ..thinking import check_budget, effort_budget
from . import Collected, Protocol, Request, RequestError, flag, number, sse, texts, whole, with_silences
from .chat import chat_ids

# What a status is called in Anthropic's error shape.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
MAX_STOP_SEQUENCES = 16
# Fields asking for what only Anthropic's own service runs: refused (400 naming the field), not ignored.
REFUSED = ("mcp_servers", "container")


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                       and isinstance(b.get("text"), str) for b in value):
        value = "".join(block["text"] for block in value)
    if not isinstance(value, str):
        raise RequestError(400, f"{where} must be a string or a list of text blocks", where.split("[")[0])
    return value


def _block_error(where: str, role: str) -> RequestError:
    kinds = "text, tool_use and thinking" if role == "assistant" else "text and tool_result"
    return RequestError(400, f"{where}.type must be one of {kinds} in a {role} message (this server reads text "
                             "only)", "messages")


# A system block that carries a client's metadata for Anthropic's service and no instruction
# for the model: Claude Code's first block, "x-anthropic-billing-header: cc_version=...;
# cch=...;", whose value changes between requests. Left out of the prompt, so consecutive
# turns share their whole prefix and the prompt cache keeps it.
CLIENT_METADATA = re.compile(r"x-anthropic-[a-z0-9-]+:[^\n]*(\n|$)", re.I)


def _system_text(value: Any, where: str) -> str:
    """A system prompt (a string or text blocks) as one text, client metadata left out."""
    if isinstance(value, list):
        value = [block for block in value if not (isinstance(block, dict) and isinstance(block.get("text"), str)
                                                  and CLIENT_METADATA.fullmatch(block["text"].strip()))]
    text = _text(value, where)
    return CLIENT_METADATA.sub("", text, count=1) if CLIENT_METADATA.match(text) else text


def conversation(body: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``system`` and ``messages`` as OpenAI's messages (tool_use blocks as an assistant's
    tool_calls, tool_result blocks as tool messages, a system message among the messages,
    Anthropic's mid-conversation system message, where it stands)."""
    out: List[Dict[str, Any]] = []
    if body.get("system") is not None:
        system = _system_text(body["system"], "system")
        if system:
            out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {'role': 'user' or 'assistant', 'content': ...}",
                           "messages")
    for index, message in enumerate(messages):
        at = f"messages[{index}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise RequestError(400, f"{at} must be an object whose role is 'user', 'assistant' or 'system'",
                               "messages")
        if role == "system":
            text = _system_text(message.get("content"), f"{at}.content")
            if text:
                out.append({"role": "system", "content": text})
            continue
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(400, f"{at}.content must be a string or a list of content blocks", "messages")
        text, calls, results = "", [], []
        for number_, block in enumerate(content):
            where = f"{at}.content[{number_}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text += block["text"]
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
                        not isinstance(block.get("input", {}), dict):
                    raise RequestError(400, f"{where} must have a string id and name and an input object", "messages")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input", {})}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise RequestError(400, f"{where}.tool_use_id must name a tool_use block of an earlier message",
                                       "messages")
                result = _text(block.get("content", ""), f"{where}.content")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": f"Error: {result}" if block.get("is_error") else result})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise _block_error(where, role)
        if role == "user":
            out += results
            if text or not results:
                out.append({"role": "user", "content": text})
        else:
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
    if all(message["role"] == "system" for message in out):
        raise RequestError(400, "messages must hold a user message, not only system ones", "messages")
    return out


def tools(value: Any) -> Tuple[Optional[List[Dict[str, Any]]], List[str]]:
    """Anthropic's tools as OpenAI's function tools (checked again there), and the names of
    those left out: Anthropic's own tools (``web_search_*``, ``code_execution_*``, ``bash_*``
    and the like: a ``type`` and no ``input_schema``), which run on Anthropic's service or
    need its schema. The model is not offered them, and the reply's usage names them."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise RequestError(400, "tools must be a list of {'name': ..., 'description': ..., 'input_schema': {...}}",
                           "tools")
    out, left_out = [], []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise RequestError(400, f"{where} must be an object", "tools")
        if tool.get("type", "custom") not in ("custom", None) and "input_schema" not in tool:
            left_out.append(str(tool.get("name") or tool["type"]))
            continue
        if not isinstance(tool.get("input_schema"), dict):
            raise RequestError(400, f"{where}.input_schema must be a JSON schema object", "tools")
        function = {k: tool[k] for k in ("name", "description") if tool.get(k) is not None}  # (chat's order)
        out.append({"type": "function", "function": {**function, "parameters": tool["input_schema"]}})
    return out, left_out


def tool_choice(value: Any) -> Any:
    """Anthropic's tool_choice as OpenAI's: auto, required (any), a named function (tool), none."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "tool" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    if kind not in ("auto", "any", "none"):
        raise RequestError(400, "tool_choice must be {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or "
                                "{'type': 'tool', 'name': ...}", "tool_choice")
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def thinking(value: Any, max_tokens: Optional[int], effort: Optional[int]) -> Tuple[bool, Optional[int]]:
    """Whether the model thinks first, and its budget (None: none); ``effort``: the budget
    output_config.effort names, for adaptive thinking."""
    if value is None:
        return False, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return False, None
    if kind in ("adaptive", "between_tools"):
        return True, effort
    if kind != "enabled":
        raise RequestError(400, "thinking must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'adaptive'} or "
                                "{'type': 'disabled'}", "thinking")
    budget = check_budget(value.get("budget_tokens"), "thinking.budget_tokens")
    if budget is None or (max_tokens is not None and budget >= max_tokens):
        raise RequestError(400, "thinking.budget_tokens must be a whole number of tokens below max_tokens", "thinking")
    return True, budget


def prompt(body: Any, engine, counting: bool = False) -> Tuple[List[int], Any, Dict[str, Any], List[str]]:
    """A Messages request's prompt, reply reader, options and the tools left out (tools),
    checked (``counting``: for count_tokens, which takes no max_tokens)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise RequestError(400, "model is required: any name (this server answers with the model it loaded)", "model")
    for name in REFUSED:
        if body.get(name):
            raise RequestError(400, f"{name} is not supported by this server; leave it out", name)
    limit = engine.context_length or 1 << 30
    max_tokens = whole(body, "max_tokens", 1, limit, required=not counting)
    output = body.get("output_config") or {}
    if not isinstance(output, dict):
        raise RequestError(400, "output_config must be an object such as {'effort': 'low'}", "output_config")
    effort = effort_budget(output.get("effort"), "output_config.effort")
    response_format = _output_format(output.get("format"))
    thinks, budget = thinking(body.get("thinking"), max_tokens, effort)
    offered, left_out = tools(body.get("tools"))
    ids, splitter = chat_ids(engine, conversation(body), offered or None, tool_choice(body.get("tool_choice")),
                             thinks, counting=counting)
    if splitter.forced_call:  # the reply is a tool call: the format is for answer text
        response_format = None
    return ids, splitter, {"thinking_budget": budget, "max_tokens": max_tokens, "response_format": response_format}, \
        left_out


def _output_format(value: Any) -> Optional[Dict[str, Any]]:
    """``output_config.format`` ({"type": "json_schema", "schema": {...}}) as chat
    completions' response_format, checked."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise UserError("output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config")
    response_format = {"type": "json_schema", "json_schema": value}
    response_grammar(response_format, "output_config.format")
    return response_format


class Messages(Protocol):
    """Anthropic's Messages API."""

    def parse(self, body: Any, engine, default_max_tokens: int) -> Request:
        ids, splitter, options, left_out = prompt(body, engine)
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise RequestError(400, "metadata must be an object", "metadata")
        options = ReplyOptions(**options, temp=number(body, "temperature", 0.0, 0.0, 1.0),
                               top_p=number(body, "top_p", 1.0, 0.0, 1.0),
                               top_k=whole(body, "top_k", 0, 1 << 30, default=0),
                               stop=[check_text(text, "stop_sequences")
                                     for text in texts(body, "stop_sequences", MAX_STOP_SEQUENCES) or []])
        return Request(ids=ids, chat=True, stream=flag(body, "stream"), options=options, model=body["model"],
                       splitter=splitter, protocol=self, echo={"model": body["model"], "tools_left_out": left_out})

    def count(self, body: Any, engine) -> Dict[str, Any]:
        """``/v1/messages/count_tokens``: the prompt's tokens."""
        ids = prompt(body, engine, counting=True)[0]
        return {"input_tokens": len(ids)}

    def error(self, error: RequestError) -> Dict[str, Any]:
        kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}

    @staticmethod
    def _stop(last) -> Tuple[str, Optional[str]]:
        finish = last.finish_reason
        if finish == "tool_calls":
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        if last.stop_sequence is not None:
            return "stop_sequence", last.stop_sequence
        return "end_turn", None

    @staticmethod
    def _usage(request: Request, usage: Dict[str, Any]) -> Dict[str, Any]:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        left_out = request.echo["tools_left_out"]
        return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
                "time_to_first_token": usage["time_to_first_token"], "speculation": usage["speculation"],
                **({"tools_left_out": left_out} if left_out else {})}

    @staticmethod
    def _message(request: Request, content: List[Dict[str, Any]]) -> Dict[str, Any]:
        return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                "model": request.echo["model"], "content": content, "stop_reason": None, "stop_sequence": None}

    def reply(self, request: Request, collected: Collected, usage: Dict[str, Any]) -> Dict[str, Any]:
        content: List[Dict[str, Any]] = []
        if collected.reasoning:
            content.append({"type": "thinking", "thinking": collected.reasoning, "signature": ""})
        if collected.text or not collected.calls:
            content.append({"type": "text", "text": collected.text})
        content += [{"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": call.input()}
                    for call in collected.calls]
        stop_reason, stop_sequence = self._stop(collected.last)
        return {**self._message(request, content), "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage(request, usage)}

    def _start(self, request: Request, to_read: int) -> bytes:
        """``message_start``, sent once the prompt's cached part is known, with usage split as
        the final ``message_delta`` splits it (no token counted twice)."""
        request.echo["started"] = True
        message = self._message(request, [])
        message["usage"] = {"input_tokens": to_read, "cache_read_input_tokens": len(request.ids) - to_read,
                            "cache_creation_input_tokens": 0, "output_tokens": 0}
        return sse("message_start", {"type": "message_start", "message": message})

    def events(self, request: Request, responses: Iterator[Any],
               usage: Callable[[Any], Dict[str, Any]]) -> Iterator[bytes]:
        # message_start waits for the reading's first word (keepalive), which says what is cached.
        blocks = _Blocks()
        last = None
        for last, silent in with_silences(responses):
            if not request.echo.get("started"):
                yield self._start(request, len(request.ids) - last.prompt_reused)
            if silent:
                yield from blocks.alive()
            if last.reasoning:
                yield from blocks.delta("thinking", {"type": "thinking_delta", "thinking": last.reasoning})
            if last.text:
                yield from blocks.delta("text", {"type": "text_delta", "text": last.text})
            for call in last.tool_calls:
                yield from blocks.tool(call)
        if last is None or last.finish_reason is None:
            return  # cut off: the server says so in its own error event (pings went before, as Anthropic's may)
        if blocks.index < 0:  # an empty reply: one empty text block, as the whole reply has
            yield blocks._start({"type": "text", "text": ""})
        yield from blocks.close()
        stop_reason, stop_sequence = self._stop(last)
        yield sse("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                    "usage": self._usage(request, usage(last))})
        yield sse("message_stop", {"type": "message_stop"})

    def stream_error(self, error: RequestError) -> bytes:
        return sse("error", self.error(error))

    def keepalive(self, request: Request, to_read: Optional[int] = None) -> bytes:
        if to_read is not None and not request.echo.get("started"):
            return self._start(request, to_read) + sse("ping", {"type": "ping"})
        return sse("ping", {"type": "ping"})


class _Blocks:
    """The content blocks of a streamed reply: which is open, and their indices."""

    def __init__(self):
        self.index, self.open = -1, None

    def _start(self, block: Dict[str, Any]) -> bytes:
        self.index += 1
        self.open = block["type"]
        return sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def close(self) -> Iterator[bytes]:
        if self.open is not None:
            yield sse("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open = None

    def delta(self, kind: str, delta: Dict[str, Any]) -> Iterator[bytes]:
        if self.open != kind:
            yield from self.close()
            yield self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                              else {"type": "text", "text": ""})
        yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def alive(self) -> Iterator[bytes]:
        """An empty delta in the open block (a text block opened for it where none is): an
        event Claude Code counts as activity, as it does not count pings. A text block so
        opened ahead of a call stays empty in the stream, where the whole reply has none."""
        if self.open == "thinking":
            yield from self.delta("thinking", {"type": "thinking_delta", "thinking": ""})
        else:
            yield from self.delta("text", {"type": "text_delta", "text": ""})

    def tool(self, call) -> Iterator[bytes]:
        yield from self.close()
        yield self._start({"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": {}})
        yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        yield from self.close()


def _tool_id(call_id: str) -> str:
    """Anthropic's spelling of a call's id."""
    return "toolu_" + call_id.split("_", 1)[-1]
