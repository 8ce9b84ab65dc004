"""What agents send and get back: tools, tool calls and their results, reasoning and
log-probabilities, through the Engine, ChatSession and the server, on the real
Qwen2.5-Coder-0.5B-Instruct (a chat template with tools); every reply is the target's own
greedy text, drafting on. The splitting of a reply is also checked piece by piece on
scripted text, for the formats the model at hand does not write."""

import json
import threading

import openai
import pytest
from mlx_lm.tool_parsers import json_tools

from mlx_eagle.errors import UserError
from mlx_eagle.replies import check_messages
from mlx_eagle.replies import ReplySplitter, chat_prompt, may_become_call
from mlx_eagle.engine import Engine
from mlx_eagle.session import ChatSession
from plain import plain_tokens

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]
ASK = [{"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
       {"role": "user", "content": "What is the weather in Paris right now?"}]


def prompt_ids(tokenizer, messages, tools, choice=None):
    """The prompt the engine builds for ``messages``, as an agent sends them."""
    return chat_prompt(tokenizer, check_messages(messages), tools, choice)[0]


@pytest.fixture(scope="module")
def engine(qwen_coder):
    model, tokenizer = qwen_coder
    engine = Engine(loaded=(model, tokenizer, None), name="qwen-coder", history=False)
    yield engine
    engine.close()


def replied(pieces):
    """(answer text, reasoning, tool calls, finish reason, tokens) of a streamed chat reply."""
    text = reasoning = ""
    calls, tokens, finish = [], [], None
    for piece in pieces:
        text += piece.text
        reasoning += piece.reasoning
        calls += piece.tool_calls
        tokens.append(piece.token)
        finish = piece.finish_reason
    return text, reasoning, calls, finish, tokens


def test_a_tool_call_is_returned_as_a_call_and_a_tool_result_is_answered(engine, qwen_coder):
    model, tokenizer = qwen_coder
    ids = prompt_ids(tokenizer, ASK, TOOLS)
    text, _, calls, finish, tokens = replied(engine.chat(ASK, tools=TOOLS, max_tokens=64))
    assert tokens == plain_tokens(model, ids, 64, tokenizer.eos_token_ids)  # the model's own text, drafting on
    assert finish == "tool_calls" and text.strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    answered = ASK + [{"role": "assistant", "content": None, "tool_calls": [calls[0].openai()]},
                      {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature_c": 18, "sky": "clear"}'}]
    ids = prompt_ids(tokenizer, answered, TOOLS)
    text, _, calls, finish, tokens = replied(engine.chat(answered, tools=TOOLS, max_tokens=48))
    assert tokens == plain_tokens(model, ids, 48, tokenizer.eos_token_ids)
    assert calls == [] and finish in ("stop", "length") and "18" in text


def test_tool_choice_none_hides_the_tools_and_a_named_function_is_called(engine, qwen_coder):
    model, tokenizer = qwen_coder
    text, _, calls, finish, _ = replied(engine.chat(ASK, tools=TOOLS, tool_choice="none", max_tokens=24))
    assert calls == [] and text and finish in ("stop", "length")
    named = {"type": "function", "function": {"name": "add"}}
    ask = ASK[:1] + [{"role": "user", "content": "What is 2 plus 40?"}]
    ids = prompt_ids(tokenizer, ask, TOOLS, named)
    _, _, calls, finish, tokens = replied(engine.chat(ask, tools=TOOLS, tool_choice=named, max_tokens=32))
    assert tokens == plain_tokens(model, ids, 32, tokenizer.eos_token_ids)
    assert finish == "tool_calls" and [c.name for c in calls] == ["add"]
    assert json.loads(calls[0].arguments) == {"a": 2, "b": 40}
    # A forced call is the reply: a response_format beside it (for answer text) does not
    # hold the call's arguments to a second JSON value (it made '{{"a": ...}]}' before).
    with_format = replied(engine.chat(ask, tools=TOOLS, tool_choice=named, max_tokens=32,
                                      response_format={"type": "json_object"}))
    assert [c.name for c in with_format[2]] == ["add"] and with_format[4] == tokens


def test_a_chat_session_carries_tool_calls_and_results(qwen_coder, engine):
    chat = ChatSession(engine=engine, system=ASK[0]["content"], tools=TOOLS, max_tokens=64)
    pieces = list(chat.send(ASK[1]["content"]))
    call = next(c for p in pieces for c in p.tool_calls)
    assert pieces[-1].finish_reason == "tool_calls" and chat.history[-1]["tool_calls"][0]["id"] == call.id
    answer = "".join(p.text for p in chat.send_tool_results({call.id: '{"temperature_c": 18}'}))
    assert "18" in answer and [m["role"] for m in chat.history] == ["user", "assistant", "tool", "assistant"]
    with pytest.raises(UserError, match="tool_call_id"):
        list(chat.send_tool_results({"call_unknown": "x"}))


@pytest.fixture(scope="module")
def server(engine):
    from mlx_eagle.server import Server

    server = Server(("127.0.0.1", 0), engine=engine, quiet=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="local",
                        max_retries=0, timeout=300)
    server.shutdown()
    server.server_close()


def test_the_server_returns_tool_calls_plain_and_streamed_as_openai_does(server):
    reply = server.chat.completions.create(model="qwen-coder", messages=ASK, tools=TOOLS, max_tokens=64,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    streamed, finish = {}, None
    for chunk in server.chat.completions.create(model="qwen-coder", messages=ASK, tools=TOOLS, max_tokens=64,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            entry = streamed.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        server.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "search"}})
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        server.chat.completions.create(model="m", max_tokens=4, messages=ASK + [{"role": "tool", "content": "x"}])


class Markers:
    """The tokenizer facts mlx-lm's reply state machine reads, for a model that thinks
    (<think>) and calls tools in Qwen's JSON format."""

    has_thinking, think_start, think_end = True, "<think>", "</think>"
    has_tool_calling, tool_call_start, tool_call_end = True, "<tool_call>", "</tool_call>"
    structural_markers, response_transitions = (), {}
    tool_parser = staticmethod(json_tools.parse_tool_call)


def split(text, tools=TOOLS, by=3):
    splitter = ReplySplitter(Markers(), tools)
    pieces = [splitter.feed(text[i:i + by]) for i in range(0, len(text), by)]
    last, finish = splitter.finish("stop")
    pieces.append(last)
    return ("".join(p.content for p in pieces), "".join(p.reasoning for p in pieces),
            [(c.name, json.loads(c.arguments)) for p in pieces for c in p.tool_calls], finish)


def test_a_reply_splits_into_reasoning_answer_and_calls_however_it_streams():
    thinking = "<think>The user wants weather.</think>"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for by in (1, 2, 5, 1000):
        assert split(thinking + "Let me check." + call, by=by) == (
            "Let me check.", "The user wants weather.", [("get_weather", {"city": "Oslo"})], "tool_calls")
        assert split(thinking + "Paris is sunny.", by=by) == ("Paris is sunny.", "The user wants weather.", [],
                                                               "stop")
    # Bare JSON, as small models write calls: plain or fenced, one call or several.
    bare = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert split(bare)[2:] == ([("add", {"a": 1, "b": 2})], "tool_calls")
    assert split("```json\n[" + bare + ", " + bare + "]\n```")[2] == [("add", {"a": 1, "b": 2})] * 2
    # Not a call: JSON naming no offered tool, or any JSON when no tools were offered, stays text.
    assert split('{"name": "rm", "arguments": {}}') == ('{"name": "rm", "arguments": {}}', "", [], "stop")
    assert split(bare, tools=None) == (bare, "", [], "stop")
    # A call the parser cannot read (cut off) comes back as text, markers and all.
    assert split('<tool_call>\n{"name": "add", "argu') == ('<tool_call>\n{"name": "add", "argu', "", [], "stop")


def test_text_is_held_back_only_while_it_may_still_be_a_bare_call():
    assert all(may_become_call(t) for t in ("", "  ", "{", " [", "`", "``", "```", "```js", "```json\n{"))
    assert not any(may_become_call(t) for t in ("Hello", "```python", "``` x", "1 + 1", "```\nprint"))
    # A whole JSON value that is not a call, or a call that more text follows, streams at once.
    call = '{"name": "read", "arguments": {"path": "a.txt"}}'
    assert all(may_become_call(t) for t in (call, call + "\n", "```json\n" + call + "\n``", "[" + call))
    assert not any(may_become_call(t) for t in ('{"answer": 42}', "[1, 2]", call + "\n{", call + " and then",
                                                "```json\n" + call + "\n```\nDone"))
    splitter = ReplySplitter(Markers(), TOOLS)
    assert splitter.feed("Sure").content == "Sure" and splitter.feed(" {x}").content == " {x}"
