"""A conversation's messages, checked once for every entry point and rendered through the
model's chat template (``check_messages``, ``chat_tokens``), and what a chat reply holds
besides its text: the model's reasoning and its tool calls.

The tools a request offers are checked here (one line naming the field), rendered by the
model's chat template, and the model's tool-call text is turned into calls as the reply
streams: mlx-lm's ``TextStateMachine`` splits the text at the template's markers
(``<think>``, ``<tool_call>``, ...), and the tokenizer's own tool parser (mlx-lm's
``tool_parsers``, chosen from the chat template) reads each call.

Small models often write a call as bare JSON without the template's tags
(``{"name": ..., "arguments": {...}}``, possibly in a ```` ```json ```` fence). When tools
are offered, a reply that is exactly one such object (or a list of them) naming an offered
tool is returned as that call; while a reply may still become one (it begins with ``{``,
``[`` or a fence), its text is held back. A tool call the parser cannot read (cut off by
``max_tokens``, or malformed) is returned as text, never as an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from mlx_lm.generate import TextStateMachine, make_text_state_machine

from .errors import UserError, check_nesting, check_text
from .generation import GenerationResponse
from .infill import added_tokens, encode_as_text
from .thinking import opens_thinking

ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any, where: str = "messages", allow_empty: bool = False) -> List[Dict[str, Any]]:
    """A conversation as plain data, checked once for every entry point (the API, the
    server, bench): a list of {"role": system|user|assistant|tool, "content": text}, where
    "developer" (OpenAI's newer name) means system and content may also be a list of
    text parts, OpenAI-style. An assistant message may carry ``tool_calls`` (OpenAI's
    shape; its content may then be null), whose JSON arguments become objects for the chat
    template; a tool message names the call it answers by ``tool_call_id``. One line names
    the first problem."""
    if not isinstance(messages, list) or not (messages or allow_empty):
        raise UserError(f"{where} must be a {'' if allow_empty else 'non-empty '}list of "
                        "{'role': ..., 'content': ...} objects")
    checked, calls = [], set()
    for index, message in enumerate(messages):
        at = f"{where}[{index}]"
        role = message.get("role") if isinstance(message, dict) else None
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise UserError(f"{at} must be an object whose role is {', '.join(ROLES)}")
        content = message.get("content")
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        if content is None and tool_calls:
            content = ""
        if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                             and isinstance(part.get("text"), str) for part in content):
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise UserError(f"{at}.content must be a string or a list of text parts")
        entry: Dict[str, Any] = {"role": role, "content": check_text(content, f"{at}.content")}
        if tool_calls:
            entry["tool_calls"] = _check_tool_calls(tool_calls, f"{at}.tool_calls")
            calls.update(call["id"] for call in entry["tool_calls"])
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise UserError(f"{at}.tool_call_id must name a call of an earlier assistant message")
            entry["tool_call_id"] = call_id
        checked.append(entry)
    return checked


def _check_tool_calls(tool_calls: Any, where: str) -> List[Dict[str, Any]]:
    """An assistant message's calls, their arguments read from JSON strings."""
    if not isinstance(tool_calls, list):
        raise UserError(f"{where} must be a list of calls")
    checked = []
    for index, call in enumerate(tool_calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(call.get("id"), str) or \
                not isinstance(function.get("name"), str):
            raise UserError(f"{at} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                            "'arguments': ...}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (ValueError, RecursionError):
                raise UserError(f"{at}.function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise UserError(f"{at}.function.arguments must be a JSON object")
        check_nesting(arguments, f"{at}.function.arguments")
        checked.append({"id": call["id"], "type": "function",
                        "function": {"name": function["name"], "arguments": arguments}})
    return checked


def chat_tokens(tokenizer, messages: Sequence[Dict[str, Any]],
                tools: Optional[Sequence[Dict[str, Any]]] = None, thinking: Optional[bool] = None,
                literal: bool = False) -> List[int]:
    """The prompt for ``messages`` (and the ``tools`` offered) through the model's chat
    template, ready for the assistant's turn (a plain "role: text" rendering for models
    without a template). ``thinking``: whether a reasoning model thinks first (the
    template's ``enable_thinking``; None: its default). ``literal``: special tokens' text
    inside the messages' text (``<|im_end|>`` typed by a user) stays text, instead of
    becoming the marker the tokenizer reads it as (the template's own markers stay special).
    A system message past the first is rendered where it stands; where the template refuses
    that, it is folded into a user message's text (fold_late_system)."""
    try:
        return _rendered(tokenizer, messages, tools, thinking, literal)
    except Exception:  # a template that raises (jinja's raise_exception): some refuse a late system message
        folded = fold_late_system(messages)
        if folded == list(messages):
            raise
        return _rendered(tokenizer, folded, tools, thinking, literal)


def fold_late_system(messages: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``messages`` with every system message after the first message folded into a user
    message's text where it stood, as "System: ..." paragraphs: before the next user
    message's text, or after the last one's (for templates that take a system message only
    first, such as Anthropic's mid-conversation system messages need)."""
    out: List[Dict[str, Any]] = []
    pending: List[str] = []
    for index, message in enumerate(messages):
        if message["role"] == "system" and index > 0:
            pending.append(f"System: {message['content']}")
            continue
        if pending and message["role"] == "user":
            message = {**message, "content": "\n\n".join(pending + [message["content"]])}
            pending = []
        out.append(message)
    if pending:
        users = [index for index, message in enumerate(out) if message["role"] == "user"]
        if users:
            out[users[-1]] = {**out[users[-1]], "content": "\n\n".join([out[users[-1]]["content"]] + pending)}
        else:
            out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _rendered(tokenizer, messages: Sequence[Dict[str, Any]], tools: Optional[Sequence[Dict[str, Any]]],
              thinking: Optional[bool], literal: bool) -> List[int]:
    """chat_tokens, once, as the template renders the messages given."""
    switch = {"enable_thinking": thinking} if thinking is not None else {}
    hidden: List[str] = []
    if literal:
        messages = _hide_special(tokenizer, messages, hidden)
    if tokenizer.chat_template is None:
        text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"
    elif not hidden:
        return list(tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  add_generation_prompt=True, tokenize=True, **switch))
    else:
        text = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                             add_generation_prompt=True, tokenize=False, **switch)
    if not hidden:
        return tokenizer.encode(text)
    # The template's text read as its tokenize=True reads it (special tokens parsed; a model
    # without a template: its beginning of sequence first), the hidden pieces as text.
    ids: List[int] = [] if tokenizer.chat_template is not None else tokenizer.encode("")
    for index, piece in enumerate(_HIDDEN.split(text)):
        ids += encode_as_text(tokenizer, hidden[int(piece)]) if index % 2 else \
            tokenizer.encode(piece, add_special_tokens=False) if piece else []
    return ids


# A special token's text taken out of a message while the template renders it (private-use
# characters, which no template adds): its index among those taken out.
_HIDDEN = re.compile("\ue000(\\d+)\ue001")


def _hide_special(tokenizer, messages: Sequence[Dict[str, Any]], hidden: List[str]) -> List[Dict[str, Any]]:
    """``messages`` (checked: text content) with the special tokens' text in them replaced by
    _HIDDEN marks, the text taken out appended to ``hidden``."""
    specials = sorted({token.content for token in added_tokens(tokenizer).values() if getattr(token, "special", False)},
                      key=len, reverse=True)
    if not specials:
        return list(messages)
    pattern = re.compile("|".join(map(re.escape, specials)))

    def mark(match: "re.Match") -> str:
        hidden.append(match.group())
        return f"\ue000{len(hidden) - 1}\ue001"

    return [{**message, "content": pattern.sub(mark, message["content"])} if isinstance(message.get("content"), str)
            else message for message in messages]


TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@dataclass
class ToolCall:
    """One call the model made: OpenAI's shape, its arguments a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: Optional[int] = None) -> Dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}

    def input(self) -> Dict[str, Any]:
        """The arguments as an object (they were read as one)."""
        return json.loads(self.arguments)


@dataclass
class ReplyPiece:
    """What a stretch of the reply added: answer text, reasoning and finished tool calls."""

    content: str = ""
    reasoning: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def check_tools(tools: Any) -> List[Dict[str, Any]]:
    """OpenAI's ``tools``: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}, checked; one line names the first problem."""
    if not isinstance(tools, list):
        raise UserError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    check_nesting(tools, "tools")
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise UserError(f"{where} must be an object with type 'function' and a 'function' object")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise UserError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise UserError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise UserError(f"{where}.function.description must be a string")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise UserError(f"{where}.function.parameters must be a JSON schema object of type 'object'")
        properties, required = parameters.get("properties", {}), parameters.get("required", [])
        if not isinstance(properties, dict) or not all(isinstance(p, (dict, bool)) for p in properties.values()):
            raise UserError(f"{where}.function.parameters.properties must map each parameter's name to its schema")
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise UserError(f"{where}.function.parameters.required must be a list of parameter names")
    return tools


def check_tool_choice(choice: Any, tools: Sequence[Dict[str, Any]]) -> Any:
    """``tool_choice``: "auto", "none", "required" or {"type": "function", "function": {"name"}}
    naming one of ``tools``."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise UserError("tool_choice 'required' needs tools")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise UserError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                        "'function': {'name': ...}}")
    offered = [t["function"]["name"] for t in tools]
    if name not in offered:
        raise UserError(f"tool_choice names {name!r}, which is not in tools ({', '.join(offered) or 'none given'})")
    return choice


def check_tool_support(tokenizer) -> None:
    """One line when the model's chat template cannot render tools or read calls back."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if not tokenizer.has_tool_calling or "tools" not in template:
        raise UserError("this model's chat template has no tool calling; send the request without tools")


def forced_opening(tokenizer, choice: Any) -> str:
    """The text the reply is made to begin with for tool_choice "required" or a named
    function: the template's call opening (for a named function, its name and the opening
    of its arguments object too), which the model continues; "" for "auto" and "none". One
    line where the model's call format has no JSON opening."""
    if choice in ("auto", "none"):
        return ""
    if tokenizer.tool_call_start != "<tool_call>" or "tool_call.name" not in (tokenizer.chat_template or ""):
        raise UserError("tool_choice 'required' or a named function needs a model that writes calls as "
                        "<tool_call> JSON (Qwen, Hermes); use 'auto'")
    opening = tokenizer.tool_call_start + '\n{"name": "'
    return opening if choice == "required" else opening + choice["function"]["name"] + '", "arguments": {'


def bare_calls(text: str, tools: Sequence[Dict[str, Any]], tagged_only: Iterable[str] = ()) -> Optional[List[ToolCall]]:
    """The calls in a reply written as bare JSON (see the module's docstring), or None.
    ``tagged_only``: tools called only inside the template's call tags (where a grammar
    holds their text), whose bare JSON stays text."""
    text = text.strip()
    fenced = FENCE.match(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return None
    offered = {t["function"]["name"] for t in tools} - set(tagged_only)
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, dict) and set(c) <= {"name", "arguments", "parameters"}
                            and c.get("name") in offered for c in calls):
        return None
    return [ToolCall(c["name"], json.dumps(c.get("arguments", c.get("parameters", {})), ensure_ascii=False))
            for c in calls]


def may_become_call(text: str) -> bool:
    """Whether a reply beginning with ``text`` may still turn out to be a bare JSON call."""
    text = text.lstrip()
    if not text:
        return True
    if text[0] in "{[":
        return _may_be_one_call(text)
    if not text.startswith("```"):
        return "```".startswith(text)
    body = text[3:]
    if "json".startswith(body):  # "```" up to "```json": not decided yet
        return True
    body = (body[4:] if body.startswith("json") else body).lstrip()
    return not body or body[0] in "{[" and _may_be_one_call(body, fenced=True)


def _may_be_one_call(text: str, fenced: bool = False) -> bool:
    """Whether JSON text that began as a call could still be one: not once a whole value has
    been written that is not a call's shape, or that more text follows (a fence's close
    aside), so that such a reply streams instead of being held to its end."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:  # (not complete yet: undecided)
        return True
    calls = value if isinstance(value, list) else [value]
    shaped = bool(calls) and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                 and set(c) <= {"name", "arguments", "parameters"} for c in calls)
    rest = text[end:].strip()
    return shaped and (not rest or (fenced and "```".startswith(rest)))


def parsed_calls(parser, text: str, tools: Sequence[Dict[str, Any]]) -> Optional[List[ToolCall]]:
    """The tokenizer's parser on one call's text, as ToolCalls (None: it could not read it)."""
    try:
        parsed = parser(text, tools)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    try:
        arguments = [json.loads(c["arguments"]) if isinstance(c.get("arguments"), str) else c.get("arguments", {})
                     for c in calls]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not all(isinstance(c.get("name"), str) and isinstance(a, dict) for c, a in zip(calls, arguments)):
        return None  # OpenAI's arguments are a JSON object
    return [ToolCall(c["name"], json.dumps(a, ensure_ascii=False)) for c, a in zip(calls, arguments)]


class ReplySplitter:
    """Splits a reply's text, as it streams, into answer text, reasoning and tool calls.
    ``tools``: those the request offered (None or empty: a call is left as text);
    ``thinking``: the reply begins inside a thinking block (the template opened it)."""

    def __init__(self, tokenizer, tools: Optional[Sequence[Dict[str, Any]]] = None, opening: str = "",
                 thinking: bool = False):
        self.tools = list(tools or [])
        self.parser = tokenizer.tool_parser if self.tools else None
        self.machine = make_text_state_machine(tokenizer)
        self.markers = (tokenizer.tool_call_start or "", tokenizer.tool_call_end or "")
        self.state = self.machine.make_state("reasoning" if thinking else "normal")
        self.call_text = ""  # the call being written, between the template's markers
        self.held = ""  # answer text held back while it may be a bare JSON call
        self.content_seen = False  # the reply is known not to be a bare call: its text goes out as it comes
        self.called = False  # the reply has made a call
        self.opening = self.pending = opening  # text the reply was made to begin with: split with the first piece
        self.tagged_only: Sequence[str] = ()  # tools whose bare JSON is not a call (bare_calls)

    @property
    def forced_call(self) -> bool:
        """The reply was made to begin with a tool call (tool_choice "required" or a named
        function): it is that call, so no response_format holds it."""
        return bool(self.opening)

    def feed(self, text: str) -> ReplyPiece:
        """The reply's next piece of text; what it completes."""
        text, self.pending = self.pending + text, ""
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._take(segments)

    def finish(self, finish_reason: Optional[str]) -> Tuple[ReplyPiece, Optional[str]]:
        """What is left at the end, and the finish reason: "tool_calls" when the reply made
        calls and stopped by itself."""
        self.state, rest, _ = TextStateMachine.flush(self.state)
        piece = self._take([(self.state[0], rest)])
        late: List[ToolCall] = []
        if self.call_text:  # a call that never closed: cut off, or the format has no end marker
            late += self._read_call(self.call_text, piece, closed=False)
            self.call_text = ""
        if self.held:
            calls = bare_calls(self.held, self.tools, self.tagged_only)
            if calls:
                late += calls
            else:
                piece.content += self.held
            self.held = ""
        piece.tool_calls += late
        self.called = self.called or bool(late)
        if self.called and finish_reason == "stop":
            finish_reason = "tool_calls"
        return piece, finish_reason

    def _take(self, segments: List[Tuple[Optional[str], str]]) -> ReplyPiece:
        piece = ReplyPiece()
        previous = None
        for state, text in segments:
            if previous == "tool" and state != "tool":  # the call's end marker
                piece.tool_calls += self._read_call(self.call_text, piece)
                self.call_text = ""
            if state == "reasoning":
                piece.reasoning += text
            elif state == "tool":
                self.call_text += text
            else:
                piece.content += self._answer(text)
            previous = state
        self.called = self.called or bool(piece.tool_calls)
        return piece

    def _answer(self, text: str) -> str:
        """Answer text to hand out now (held while the reply may still be a bare call)."""
        if not self.tools or self.content_seen:
            return text
        self.held += text
        if may_become_call(self.held):
            return ""
        self.content_seen = True
        out, self.held = self.held, ""
        return out

    def _read_call(self, text: str, piece: ReplyPiece, closed: bool = True) -> List[ToolCall]:
        calls = parsed_calls(self.parser, text, self.tools) if self.parser is not None else None
        if calls is None:  # left as text, with the markers the model wrote around it
            piece.content += self.markers[0] + text + (self.markers[1] if closed else "")
            return []
        return calls


@dataclass
class ChatResponse(GenerationResponse):
    """A chat reply's piece: mlx-lm's fields, with ``text`` the answer text only, beside the
    ``reasoning`` and the finished ``tool_calls`` this piece completed."""

    reasoning: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, response: GenerationResponse, piece: ReplyPiece, finish_reason: Optional[str]) -> "ChatResponse":
        base = {f.name: getattr(response, f.name) for f in fields(GenerationResponse)}
        base.update(text=piece.content, finish_reason=finish_reason)
        return cls(**base, reasoning=piece.reasoning, tool_calls=piece.tool_calls)


def chat_prompt(tokenizer, messages: Sequence[Dict[str, Any]], tools: Optional[Sequence[Dict[str, Any]]] = None,
                tool_choice: Any = None, thinking: Optional[bool] = None,
                literal: bool = False) -> Tuple[List[int], ReplySplitter]:
    """The prompt for checked ``messages`` with the ``tools`` offered (checked here) and
    the splitter that reads the reply; one line for tools the model cannot take, whose
    ``field`` names the request field at fault (the server's 400 says it). ``thinking``,
    ``literal``: as for chat_tokens."""
    tools = _in_field("tools", lambda: check_tools(tools) if tools is not None else [])
    choice = _in_field("tool_choice", lambda: check_tool_choice(tool_choice, tools))
    if tools:
        _in_field("tools", lambda: check_tool_support(tokenizer))
    offered = tools if choice != "none" else []
    opening = _in_field("tool_choice", lambda: forced_opening(tokenizer, choice)) if offered else ""
    ids = chat_tokens(tokenizer, messages, offered, thinking, literal)
    if opening:
        ids += tokenizer.encode(opening, add_special_tokens=False)
    return ids, ReplySplitter(tokenizer, offered, opening, opens_thinking(tokenizer, ids))


def _in_field(name: str, check):
    """``check()``, its UserError marked with the request field ``name``."""
    try:
        return check()
    except UserError as error:
        error.field = name
        raise


def split_reply(responses: Iterable[GenerationResponse], splitter: ReplySplitter) -> Iterator[ChatResponse]:
    """``responses`` as chat pieces: answer text, reasoning and tool calls apart."""
    for response in responses:
        piece = splitter.feed(response.text)
        finish = response.finish_reason
        if finish is not None:
            rest, finish = splitter.finish(finish)
            piece = ReplyPiece(piece.content + rest.content, piece.reasoning + rest.reasoning,
                               piece.tool_calls + rest.tool_calls)
        yield ChatResponse.of(response, piece, finish)
