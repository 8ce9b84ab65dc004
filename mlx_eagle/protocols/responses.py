"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
as the ``openai`` SDK (and Codex CLI) speaks it.

A request's ``input`` (a string, or items: messages, ``function_call``,
``function_call_output``; earlier ``reasoning`` items are left out) and ``instructions``,
its function ``tools`` and ``tool_choice`` become the conversation in OpenAI's chat shapes,
so the same conversation is the same prompt as through chat completions. ``text.format``
holds the reply to a JSON schema (grammar.py), ``reasoning.effort`` budgets a reasoning
model's thinking (thinking.EFFORT_BUDGETS), answered as a ``reasoning`` item.

Responses are stored (``store``, true by default) in memory, under a byte bound
(``--responses-store-bytes``), the least recently used dropped first: ``previous_response_id``
continues a stored one's conversation (its input and output; not its instructions, as
OpenAI's does not), ``GET`` returns one and ``DELETE`` drops it; an id not held is a 404.
Streamed, the reply is the SDK's events: ``response.created``, ``response.in_progress``,
per output item ``response.output_item.added``, its deltas (``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``) and dones,
then ``response.completed`` (``response.incomplete`` when cut by max_output_tokens).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import UserError
from ..grammar import calls_grammar, format_grammar, lark_regex, response_grammar
from ..options import ReplyOptions
from ..thinking import effort_budget
from . import Collected, Protocol, Request, RequestError, flag, number, sse, whole, with_silences
from .chat import chat_ids
from .store import ResponseStore, not_found

# Fields that ask for nothing this server lacks at these values (others: 400 naming the field).
HARMLESS = {"truncation": (None, "disabled", "auto"), "background": (None, False), "prompt": (None,),
            "conversation": (None,)}


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text, output_text, text)."""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                       and isinstance(p.get("text"), str) for p in value):
        value = "".join(part["text"] for part in value)
    if not isinstance(value, str):
        raise RequestError(400, f"{where} must be a string or a list of input_text parts (this server reads text "
                                "only)", "input")
    return value


# Input items that record what a hosted tool did, or a client's own bookkeeping, with nothing
# the model could read here: left out of the prompt, as earlier reasoning is.
SKIPPED_ITEMS = ("reasoning", "web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call",
                 "compaction", "item_reference")


def conversation(value: Any, names: Optional[Dict[tuple, str]] = None) -> List[Dict[str, Any]]:
    """``input`` as OpenAI's chat messages: function_call (and custom_tool_call) items as the
    calls of an assistant message, their outputs as tool messages. ``names``: (namespace,
    name) -> the name the prompt offers a namespaced tool by (Tools.flat)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError(400, "input must be a string or a non-empty list of items (messages, function_call, "
                                "function_call_output)", "input")
    out: List[Dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            out.append({"role": item["role"], "content": _content(item.get("content"), f"{where}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            field = "arguments" if kind == "function_call" else "input"
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", field)):
                raise RequestError(400, f"{where} must have string call_id, name and {field}", "input")
            name = (names or {}).get((item.get("namespace"), item["name"]), item["name"])
            arguments = item["arguments"] if kind == "function_call" else json.dumps({"input": item["input"]})
            call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":  # a turn's text and calls are one assistant message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str):
                raise RequestError(400, f"{where}.call_id must name an earlier function_call", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _content(item.get("output"), f"{where}.output")})
        elif kind in SKIPPED_ITEMS:
            continue
        else:
            raise RequestError(400, f"{where} must be a message (role user, assistant, system or developer), a "
                                    "function_call, a function_call_output or a reasoning item", "input")
    if not out:
        raise RequestError(400, "input holds nothing the model reads: send a message", "input")
    return out


@dataclass
class Tools:
    """A request's tools as the prompt offers them: function tools in chat completions' shape
    (checked there), namespaces flattened into their function tools; ``namespaces``: each
    offered name of a namespaced tool -> (its namespace, its own name), which its calls come
    back under; ``custom``: each freeform tool's name -> the regular expression its text is
    held to (None: any text), offered as a function of one string, ``input``; ``left_out``:
    the tools this server cannot run (hosted ones such as ``web_search``, which run on
    OpenAI's service), not offered."""

    functions: List[Dict[str, Any]] = field(default_factory=list)
    namespaces: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    custom: Dict[str, Optional[str]] = field(default_factory=dict)
    left_out: List[str] = field(default_factory=list)

    @property
    def flat(self) -> Dict[tuple, str]:
        return {spaced: name for name, spaced in self.namespaces.items()}


def _function(tool: Dict[str, Any], name: str) -> Dict[str, Any]:
    function = {k: tool[k] for k in ("description", "parameters") if tool.get(k) is not None}  # (the SDK sends nulls)
    return {"type": "function", "function": {"name": name, **function}}


def _freeform(tool: Dict[str, Any], where: str) -> Tuple[Dict[str, Any], Optional[str]]:
    """A ``custom`` tool as the function the prompt offers (its text in one string, ``input``,
    its format's definition in the description), and the expression that text is held to:
    a regex format's own, a regular Lark grammar's (grammar.lark_regex); None for text, or
    a Lark grammar that is not regular (not held)."""
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise RequestError(400, f"{where}.format must be {{'type': 'text'}} or {{'type': 'grammar', 'syntax': "
                                "'lark' or 'regex', 'definition': ...}", "tools")
    description = tool.get("description") or ""
    pattern = None
    if fmt["type"] == "grammar":
        try:
            format_grammar(fmt, f"{where}.format")
        except UserError as error:
            raise RequestError(400, str(error), "tools") from None
        pattern = fmt["definition"] if fmt["syntax"] == "regex" else lark_regex(fmt["definition"])
        description += f"\n\nIts input follows this {fmt['syntax']} grammar:\n{fmt['definition']}"
    parameters = {"type": "object", "properties": {"input": {"type": "string", "description":
                  "The tool's whole input, as freeform text (not JSON)."}}, "required": ["input"]}
    return _function({"description": description.strip(), "parameters": parameters}, tool["name"]), pattern


def tools(value: Any) -> Tools:
    """The Responses API's tools as the prompt offers them (Tools)."""
    found = Tools()
    if value is None:
        return found
    if not isinstance(value, list):
        raise RequestError(400, "tools must be a list of {'type': 'function', 'name': ..., 'parameters': {...}}",
                           "tools")
    inner = [t.get("name") for tool in value if isinstance(tool, dict) and tool.get("type") == "namespace"
             for t in tool.get("tools") or [] if isinstance(t, dict)]
    plain = {tool.get("name") for tool in value if isinstance(tool, dict) and tool.get("type") == "function"}
    for index, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            found.functions.append(_function(tool, tool.get("name")))
        elif kind == "namespace" and isinstance(tool.get("name"), str) and isinstance(tool.get("tools"), list):
            for member in tool["tools"]:
                if not isinstance(member, dict) or member.get("type", "function") != "function":
                    raise RequestError(400, f"tools[{index}].tools must hold function tools", "tools")
                name = member.get("name")
                # (a name that another tool has too is offered under its namespace's)
                offered = name if inner.count(name) == 1 and name not in plain else f"{tool['name']}.{name}"
                found.namespaces[offered] = (tool["name"], name)
                found.functions.append(_function(member, offered))
        elif kind == "custom" and isinstance(tool.get("name"), str):
            function, found.custom[tool["name"]] = _freeform(tool, f"tools[{index}]")
            found.functions.append(function)
        elif isinstance(kind, str):
            found.left_out.append(tool.get("name") or kind)
        else:
            raise RequestError(400, f"tools[{index}] must be an object with a type, such as {{'type': 'function', "
                                    "'name': ..., 'parameters': {...}}", "tools")
    return found


def tool_choice(value: Any, offered: Tools) -> Any:
    if isinstance(value, dict) and value.get("type") in ("function", "custom") and isinstance(value.get("name"), str):
        name = offered.flat.get((value.get("namespace"), value["name"]), value["name"])
        return {"type": "function", "function": {"name": name}}
    if value is None or value in ("auto", "none", "required"):
        return value
    raise RequestError(400, "tool_choice must be 'auto', 'none', 'required' or {'type': 'function' (or 'custom'), "
                            "'name': ...}", "tool_choice")


def text_format(value: Any) -> Optional[Dict[str, Any]]:
    """``text.format`` as chat completions' response_format."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("format", {}), dict):
        raise RequestError(400, "text must be an object such as {'format': {'type': 'json_schema', ...}}", "text")
    fmt = value.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    response_grammar(fmt, "text.format")
    return fmt


class Responses(Protocol):
    """OpenAI's Responses API, with its store."""

    def __init__(self, store: ResponseStore):
        self.store = store

    def parse(self, body: Any, engine, default_max_tokens: int) -> Request:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        for name, values in HARMLESS.items():
            if body.get(name) not in values:
                raise RequestError(400, f"{name} is not supported by this server; leave it out", name,
                                   "unsupported_field")
        model = body.get("model", engine.name)
        if not isinstance(model, str):
            raise RequestError(400, "model must be a string", "model")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise RequestError(400, "instructions must be a string", "instructions")
        earlier: List[Dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise RequestError(400, f"previous_response_id must be a string (a response's id), not "
                                        f"{type(previous).__name__}", "previous_response_id")
            held = self.store.get(previous)
            if held is None:
                raise not_found(str(previous), "previous_response_id")
            earlier = held[1]
        offered = tools(body.get("tools"))
        conversation_ = earlier + conversation(body.get("input"), offered.flat)
        reasoning = body.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, dict):
            raise RequestError(400, "reasoning must be an object such as {'effort': 'low'}", "reasoning")
        effort = (reasoning or {}).get("effort")
        budget = effort_budget(effort, "reasoning.effort")
        response_format = text_format(body.get("text"))
        system = [{"role": "system", "content": instructions}] if instructions else []
        thinks = None if effort is None else effort != "none"
        choice = tool_choice(body.get("tool_choice"), offered)
        ids, splitter = chat_ids(engine, system + conversation_, offered.functions or None, choice, thinks, "input")
        if splitter.forced_call:  # the reply is a tool call: the format is for answer text
            response_format = None
        held = {name: pattern for name, pattern in offered.custom.items() if pattern is not None}
        if held and response_format is None and splitter.tools and engine.tokenizer.tool_call_start == "<tool_call>":
            named = choice["function"]["name"] if isinstance(choice, dict) else None
            if choice in ("auto", None) or named in held:
                response_format = calls_grammar([t["function"]["name"] for t in splitter.tools], held, named)
                splitter.tagged_only = list(held)
        limit = engine.context_length or 1 << 30
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise RequestError(400, "metadata must be an object", "metadata")
        options = ReplyOptions(max_tokens=whole(body, "max_output_tokens", 1, limit, default=default_max_tokens),
                               temp=number(body, "temperature", 0.0, 0.0, 2.0),
                               top_p=number(body, "top_p", 1.0, 0.0, 1.0), response_format=response_format,
                               thinking_budget=budget)
        echo = {"model": model, "instructions": instructions, "tools": body.get("tools") or [],
                "tool_choice": body.get("tool_choice") or "auto", "max_output_tokens": body.get("max_output_tokens"),
                "temperature": options.temp, "top_p": options.top_p, "previous_response_id": previous,
                "store": flag(body, "store", True), "metadata": body.get("metadata") or {},
                "text": body.get("text") or {"format": {"type": "text"}}, "reasoning": reasoning or {},
                "parallel_tool_calls": flag(body, "parallel_tool_calls", True), "conversation": conversation_,
                "namespaces": offered.namespaces, "custom": offered.custom, "tools_left_out": offered.left_out}
        return Request(ids=ids, chat=True, stream=flag(body, "stream"), options=options, model=model,
                       splitter=splitter, protocol=self, echo=echo)

    def keepalive(self, request: Request, to_read: Optional[int] = None) -> bytes:
        alive = request.echo.get("alive")
        return alive() if alive is not None else super().keepalive(request, to_read)

    def error(self, error: RequestError) -> Dict[str, Any]:
        kind = "server_error" if error.status >= 500 else "invalid_request_error"
        return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}

    def stream_error(self, error: RequestError) -> bytes:
        return sse("error", {"type": "error", "code": error.code or "server_error", "message": error.message,
                             "param": error.param})

    def _response(self, request: Request, status: str, output: List[Dict[str, Any]],
                  usage: Optional[Dict[str, Any]] = None, response_id: Optional[str] = None) -> Dict[str, Any]:
        echo = request.echo
        return {"id": response_id or f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                "status": status, "model": echo["model"], "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **{k: echo[k] for k in ("instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                                         "top_p", "previous_response_id", "store", "metadata", "text", "reasoning",
                                         "parallel_tool_calls")},
                "truncation": "disabled", "usage": usage}

    @staticmethod
    def _usage(request: Request, usage: Dict[str, Any], reasoning_tokens: int) -> Dict[str, Any]:
        left_out = request.echo["tools_left_out"]
        return {**({"tools_left_out": left_out} if left_out else {}), "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": usage["total_tokens"], "time_to_first_token": usage["time_to_first_token"],
                "speculation": usage["speculation"]}

    def _finish(self, request: Request, collected: Collected, output: List[Dict[str, Any]],
                usage: Dict[str, Any], response_id: str) -> Dict[str, Any]:
        """The finished response, stored when asked."""
        status = "incomplete" if collected.last.finish_reason == "length" else "completed"
        response = self._response(request, status, output, self._usage(request, usage, collected.reasoning_tokens),
                                  response_id)
        if request.echo["store"]:
            turn = {"role": "assistant", "content": collected.text}
            if collected.calls:
                turn["tool_calls"] = [call.openai() for call in collected.calls]
            self.store.put(response, request.echo["conversation"] + [turn])
        return response

    def reply(self, request: Request, collected: Collected, usage: Dict[str, Any]) -> Dict[str, Any]:
        output = []
        if collected.reasoning:
            output.append(_item("reasoning", f"rs_{uuid.uuid4().hex}", collected.reasoning))
        if collected.text or not collected.calls:
            output.append(_item("message", f"msg_{uuid.uuid4().hex}", collected.text))
        output += [_call_item(call, request.echo) for call in collected.calls]
        return self._finish(request, collected, output, usage, f"resp_{uuid.uuid4().hex}")

    def events(self, request: Request, responses: Iterator[Any],
               usage: Callable[[Any], Dict[str, Any]]) -> Iterator[bytes]:
        response_id = f"resp_{uuid.uuid4().hex}"
        items = _Items(request.echo)
        started = self._response(request, "in_progress", [], None, response_id)
        yield items.event("response.created", response=started)
        yield items.event("response.in_progress", response=started)
        # While nothing else is said (waiting for a seat, the prompt read, text held while it may
        # be a call), an event clients count as activity: Codex's idle limit skips comments.
        request.echo["alive"] = lambda: items.event("response.in_progress", response=started)
        collected = Collected()
        for piece, silent in with_silences(responses):
            if silent:
                yield request.echo["alive"]()
            collected.add(piece)
            if piece.reasoning:
                yield from items.delta("reasoning", piece.reasoning)
            if piece.text:
                yield from items.delta("message", piece.text)
            for call in piece.tool_calls:
                yield from items.call(call)
        if collected.last is None or collected.last.finish_reason is None:
            return  # cut off: the server says so in its own error event
        yield from items.close()
        if not items.output:  # an empty reply is still a message
            yield from items.delta("message", "")
            yield from items.close()
        response = self._finish(request, collected, items.output, usage(collected.last), response_id)
        yield items.event("response.completed" if response["status"] == "completed" else "response.incomplete",
                          response=response)


def _part(kind: str, text: str) -> Dict[str, Any]:
    """A message's output_text part, or a reasoning item's reasoning_text."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(kind: str, item_id: str, text: Optional[str]) -> Dict[str, Any]:
    """A message or reasoning item, finished with ``text`` (None: just begun, no content yet)."""
    content = [] if text is None else [_part(kind, text)]
    if kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content}
    return {"type": "message", "id": item_id, "status": "in_progress" if text is None else "completed",
            "role": "assistant", "content": content}


def _call_item(call, echo: Dict[str, Any], status: str = "completed") -> Dict[str, Any]:
    """A function_call item, a namespaced tool's call under its own name and its namespace (as
    Codex reads it); a freeform tool's call, a custom_tool_call item with its text."""
    if call.name in echo["custom"]:
        try:
            text = json.loads(call.arguments).get("input")
        except (ValueError, AttributeError):
            text = None
        return {"type": "custom_tool_call", "id": "ctc_" + call.id.split("_", 1)[-1], "call_id": call.id,
                "name": call.name, "input": (text if isinstance(text, str) else call.arguments)
                if status == "completed" else "", "status": status}
    namespace, name = echo["namespaces"].get(call.name, (None, call.name))
    return {"type": "function_call", "id": "fc_" + call.id.split("_", 1)[-1], "call_id": call.id, "name": name,
            **({"namespace": namespace} if namespace else {}),
            "arguments": call.arguments if status == "completed" else "", "status": status}


class _Items:
    """The output items of a streamed response: which is open, their events, and the items
    finished so far (``output``)."""

    def __init__(self, echo: Dict[str, Any]):
        self.echo = echo  # (the request's tools: how a call's item is written)
        self.output: List[Dict[str, Any]] = []
        self.sequence = 0
        self.open: Optional[str] = None
        self.item_id, self.text = "", ""

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(kind, data)

    def _where(self) -> Dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.output), "content_index": 0}

    def delta(self, kind: str, text: str) -> Iterator[bytes]:
        if self.open != kind:
            yield from self.close()
            self.open, self.text = kind, ""
            self.item_id = f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}"
            yield self.event("response.output_item.added", output_index=len(self.output),
                             item=_item(kind, self.item_id, None))
            yield self.event("response.content_part.added", part=_part(kind, ""), **self._where())
        self.text += text
        if text:
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            yield self.event(name, delta=text, **self._where(), **extra)

    def close(self) -> Iterator[bytes]:
        if self.open is None:
            return
        item = _item(self.open, self.item_id, self.text)
        if self.open == "reasoning":
            yield self.event("response.reasoning_text.done", text=self.text, **self._where())
        else:
            yield self.event("response.output_text.done", text=self.text, logprobs=[], **self._where())
        yield self.event("response.content_part.done", part=item["content"][0], **self._where())
        yield self.event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.open = None

    def call(self, call) -> Iterator[bytes]:
        yield from self.close()
        added, item = _call_item(call, self.echo, "in_progress"), _call_item(call, self.echo)
        index = len(self.output)
        yield self.event("response.output_item.added", output_index=index, item=added)
        if item["type"] == "custom_tool_call":
            yield self.event("response.custom_tool_call_input.delta", item_id=added["id"], output_index=index,
                             delta=item["input"])
            yield self.event("response.custom_tool_call_input.done", item_id=added["id"], output_index=index,
                             input=item["input"])
        else:
            yield self.event("response.function_call_arguments.delta", item_id=added["id"], output_index=index,
                             delta=call.arguments)
            yield self.event("response.function_call_arguments.done", item_id=added["id"], output_index=index,
                             arguments=call.arguments, name=call.name)
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
