"""The OpenAI-compatible server as a real process on loopback, spoken to with the
official ``openai`` client: plain and streamed chat completions (the target's own
greedy text), completions, models and health, a client that leaves mid-stream, and a
batch of malformed requests that each get a 4xx while the server keeps serving."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from mlx_eagle import resolve_model, stream_generate
from mlx_eagle.replies import chat_tokens
from mlx_eagle.scheduler import REPLY_SECONDS_PRIOR
from mlx_eagle.heads import new_head, save_head

pytestmark = pytest.mark.slow  # a server process with the real SmolLM2

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]


def start_server(*args):
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_eagle.server", "--port", "0", "--quiet", *args],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE, text=True)
    lines = []
    for line in process.stderr:
        lines.append(line)
        match = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
        if match:
            return process, ("127.0.0.1", int(match.group(1)))
    raise AssertionError("the server did not start: " + "".join(lines))


@pytest.fixture(scope="module")
def server(smollm, tmp_path_factory):
    """``python -m mlx_eagle.server --port 0`` with a random EAGLE-3 head; yields its address."""
    head = tmp_path_factory.mktemp("head") / "random-eagle3"
    save_head(new_head(smollm[0], "eagle3", seed=6), head)
    process, address = start_server("--draft", str(head))
    yield address
    process.terminate()
    _, rest = process.communicate(timeout=30)
    assert process.returncode == 0, rest

def client(server) -> openai.OpenAI:
    host, port = server
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="local", max_retries=0, timeout=300)


def plain_text(smollm, ids, max_tokens):
    model, tokenizer = smollm
    return "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft=None))


def raw(server, method, path, body=b"", headers=None):
    connection = http.client.HTTPConnection(*server, timeout=300)
    connection.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, json.loads(payload)


def health(server):
    return raw(server, "GET", "/health")[1]


def test_chat_completion_plain_and_streamed(server, smollm):
    expected = plain_text(smollm, chat_tokens(smollm[1], QUESTION), 40)
    reply = client(server).chat.completions.create(model="SmolLM2", messages=QUESTION, max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(chat_tokens(smollm[1], QUESTION))
    speculation = reply.usage.model_extra["speculation"]
    assert speculation["tokens_per_forward"] >= 1 and speculation["target_forwards"] >= 1

    stream = client(server).chat.completions.create(model="SmolLM2", messages=QUESTION, max_tokens=40,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    # The second request shares the first's prompt: its cache held it.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_models_and_health(server, smollm):
    prompt = "The three primary colors are"
    completion = client(server).completions.create(model="SmolLM2", prompt=prompt, max_tokens=12, temperature=0)
    assert completion.choices[0].text == plain_text(smollm, smollm[1].encode(prompt), 12)
    assert [m.id for m in client(server).models.list()] == [resolve_model().name]
    assert health(server)["status"] == "ok"


def test_a_client_that_leaves_mid_stream_cancels_its_generation(server):
    before = health(server)["cancelled"]
    connection = http.client.HTTPConnection(*server, timeout=300)
    body = json.dumps({"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
                       "max_tokens": 2000, "stream": True})
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    while not response.fp.readline().startswith(b"data:"):
        pass
    response.close()  # gone, 2,000 tokens before the end (the response owns the socket now)
    connection.close()
    deadline = time.monotonic() + 120
    while health(server)["cancelled"] == before:
        assert time.monotonic() < deadline, "the generation went on without its client"
        time.sleep(0.2)
    reply = client(server).chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
    assert reply.choices[0].message.content


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_while_its_long_prompt_is_read_cancels_it(server, stream):
    """A request whose client leaves while its 7,000-token prompt is read (a minute and more
    on this CPU) is cancelled at the next 512-token chunk, when the server's keep-alive
    (an SSE comment, or a plain reply's leading space) finds the pipe broken; the server then
    serves on."""
    before = health(server)["cancelled"]
    connection = http.client.HTTPConnection(*server, timeout=300)
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 7000 + "How many words?"}],
                       "max_tokens": 8, "stream": stream})
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.fp.readline().startswith(b"data:")  # the role, before reading
        response.close()
    connection.close()
    deadline = time.monotonic() + 45  # far less than reading the whole prompt takes
    while health(server)["cancelled"] == before:
        assert time.monotonic() < deadline, "the prompt was read on without its client"
        time.sleep(0.2)
    assert client(server).chat.completions.create(model="m", messages=QUESTION, max_tokens=4).choices[0].message.content


DEEP = json.loads("[" * 300 + "]" * 300)  # nested 300 deep
MALFORMED = [
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", json.dumps({"model": "m"}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": "hello"}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "max_tokens": 10 ** 9}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "max_tokens": "ten"}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "temperature": "hot"}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "stream": "yes"}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "n": 3}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "stop": 5}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps([1, 2]).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": ""}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": [10 ** 7]}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "word " * 9000}).encode(), 400),
    ("POST", "/v1/chat/completions", b"{" + b" " * (2 << 20) + b"}", 413),
    ("POST", "/v1/embeddings", b"{}", 404),
    ("GET", "/v1/nothing", b"", 404),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "seed": -1}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "seed": -1, "stream": True}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "\ud800 hi"}]}).encode(),
     400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "\ud800 hi"}],
                                                 "stream": True}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "\udfff"}).encode(), 400),
    ("POST", "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION}).encode(), 415, {"Content-Type": "text/plain"}),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION}).encode(), 403,
     {"Content-Type": "application/json", "Host": "attacker.example:8080"}),
    ("GET", "/health", b"", 403, {"Host": "rebound.example"}),
    ("GET", "/health", b"", 403, {"Host": "localhost:80@evil.com"}),
    ("GET", "/health", b"", 403, {"Host": "localhost evil.com"}),
    # The reliability tour's: a boolean asked for with 1, a stop string no text can hold,
    # tools and tool-call arguments nested 300 deep (a RecursionError in the template), a
    # tool whose parameters are not a schema.
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "logprobs": 1}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "stop": ["\ud800"]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": DEEP}}}}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": json.dumps({"a": DEEP})}}]}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": ["a"]}}}]}).encode(), 400),
    ("GET", "/v1/chat/completions", b"", 405),
    ("POST", "/health", b"{}", 405),
    ("PUT", "/v1/chat/completions", b"{}", 405),
    ("DELETE", "/v1/models", b"", 405),
    ("OPTIONS", "/v1/chat/completions", b"", 405),
    ("GET", "/v1/models/some-other-model", b"", 404),
    # Log-probabilities, tools and tool messages asked for wrongly; tools to a model whose
    # chat template has none (SmolLM2's).
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "top_logprobs": 3}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "logprobs": True,
                                                 "top_logprobs": 21}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "logprobs": "yes"}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "logprobs": 9}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tools": [
        {"type": "function", "function": {"name": "f"}}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tools": {"f": 1}}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tools": [
        {"type": "function", "function": {"name": "no spaces"}}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": []}}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tool_choice": "required"}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tool_choice": "sometimes"}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
            "name": "g"}}}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION + [
        {"role": "tool", "content": "42"}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "{not json"}}]}]}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "response_format": {"type": "xml"}}).encode(),
     400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "strng"}}}}}}).encode(), 400),
    # Fields the server does not implement: a 400 naming the field, never a silent 200.
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "presence_penalty": 1.0}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "logit_bias": {"5": 100}}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "echo": True}).encode(), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "tools": [{"unhashable": []}]}).encode(), 400),
]


def test_logprobs_are_the_targets_own_plain_and_streamed(server, smollm):
    """The log-probabilities a reply carries (drafting on, read from the verify pass) are
    the ones plain mlx-lm decoding computes, within float tolerance, with the top ones."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, tokenizer = smollm
    ids = chat_tokens(tokenizer, QUESTION)
    plain = [(t, lp) for (t, lp), _ in zip(generate_step(mx.array(ids), model, max_tokens=24), range(24))]
    reply = client(server).chat.completions.create(model="m", messages=QUESTION, max_tokens=24, temperature=0,
                                                   logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) >= 8
    for entry, (token, logprobs) in zip(content, plain):
        assert entry.token == tokenizer.decode([token])
        assert abs(entry.logprob - float(logprobs[token])) < 1e-4
        best = mx.argsort(-logprobs)[:3].tolist()
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in best]
        assert all(abs(t.logprob - float(logprobs[b])) < 1e-4 for t, b in zip(entry.top_logprobs, best))
    streamed = [entry for chunk in client(server).chat.completions.create(
        model="m", messages=QUESTION, max_tokens=24, temperature=0, logprobs=True, stream=True)
        if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    text = client(server).completions.create(model="m", prompt="The capital of France is", max_tokens=6,
                                             temperature=0, logprobs=2)
    legacy = text.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == 6 and all(len(t) == 2 for t in legacy.top_logprobs)


def test_structured_replies_follow_their_schema_plain_and_streamed(server, smollm):
    """A JSON-schema reply, drafting on, is plain constrained decoding's text (which
    test_grammar checks against mlx-lm's own loop), whole and streamed; its log-probabilities
    name no token the grammar refused; an unknown type in the schema is a 400 naming it."""
    model, tokenizer = smollm
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "country", "is_capital"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    expected = "".join(r.text for r in stream_generate(model, tokenizer, chat_tokens(tokenizer, QUESTION),
                                                       max_tokens=60, draft=None, response_format=response_format))
    reply = client(server).chat.completions.create(model="m", messages=QUESTION, max_tokens=60, temperature=0,
                                                   response_format=response_format, logprobs=True, top_logprobs=20)
    assert reply.choices[0].message.content == expected
    assert set(json.loads(expected)) == {"city", "country", "is_capital"}
    assert all(t.logprob > -float("inf") for e in reply.choices[0].logprobs.content for t in e.top_logprobs)
    streamed = client(server).chat.completions.create(model="m", messages=QUESTION, max_tokens=60, temperature=0,
                                                      response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
    anything = client(server).chat.completions.create(model="m", messages=QUESTION, max_tokens=40, temperature=0,
                                                      response_format={"type": "json_object"})
    json.loads(anything.choices[0].message.content)  # the value, and nothing after it
    with pytest.raises(openai.BadRequestError, match="strng") as raised:
        client(server).chat.completions.create(model="m", messages=QUESTION, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}})
    assert raised.value.body["param"] == "response_format"


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server):
    for method, path, body, status, *headers in MALFORMED:
        got, payload = raw(server, method, path, body, *headers)
        assert got == status, (method, path, body[:80], payload)
        assert payload["error"]["message"], payload
        if payload["error"]["code"] == "unsupported_field":
            field = payload["error"]["param"]
            assert field in body.decode() and field in payload["error"]["message"]
    # The same fields asking for nothing the server lacks are served.
    harmless = {"logprobs": False, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    assert raw(server, "POST", "/v1/chat/completions", json.dumps(dict(messages=QUESTION, max_tokens=2,
                                                                       **harmless)).encode())[0] == 200
    for path, status in (("/health", 200), ("/", 200), ("/v1/chat/completions", 405)):  # HEAD where GET is
        connection = http.client.HTTPConnection(*server, timeout=60)
        connection.request("HEAD", path)
        response = connection.getresponse()
        assert response.status == status and response.read() == b""  # no body for HEAD
        connection.close()
    assert raw(server, "GET", "/health?probe=1")[0] == 200  # a query string does not change the route
    assert client(server).models.retrieve(resolve_model().name).id == resolve_model().name
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server).chat.completions.create(model="m", messages=QUESTION, max_tokens=10 ** 9)
    reply = client(server).chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
    assert reply.choices[0].message.content


def test_a_shutdown_cuts_replies_in_flight_with_an_error_not_a_finish():
    """SIGTERM while one reply streams and another waits: neither looks finished."""
    process, address = start_server("--draft", "none")
    story = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}], "max_tokens": 2000}
    streaming = http.client.HTTPConnection(*address, timeout=300)
    streaming.request("POST", "/v1/chat/completions", body=json.dumps(dict(story, stream=True)),
                      headers={"Content-Type": "application/json"})
    stream = streaming.getresponse()
    assert stream.status == 200
    while not stream.fp.readline().startswith(b"data:"):
        pass
    waiting = http.client.HTTPConnection(*address, timeout=300)
    waiting.request("POST", "/v1/chat/completions", body=json.dumps(story),
                    headers={"Content-Type": "application/json"})
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    rest = stream.read().decode()
    assert "[DONE]" not in rest and '"finish_reason": "stop"' not in rest
    assert "shutting down" in rest.strip().splitlines()[-1]
    response = waiting.getresponse()
    assert response.status == 503 and "shutting down" in json.loads(response.read())["error"]["message"]
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr


def exchange(address, data: bytes, half_close: bool = True, timeout: float = 120) -> bytes:
    """Send raw bytes (then shut the sending side, as ``nc -N`` does) and read to EOF."""
    import socket

    with socket.create_connection(address, timeout=timeout) as connection:
        connection.sendall(data)
        if half_close:
            connection.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    return received


def http_post(path: str, body: dict, extra: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n").encode() + extra + b"\r\n" + data


def status_and_body(received: bytes):
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.fixture(scope="module")
def impatient_server():
    """A server that drops a silent client after 2 s, drafting from the context alone."""
    process, address = start_server("--draft", "none", "--idle-seconds", "2")
    yield address
    process.terminate()
    process.communicate(timeout=30)


def test_a_client_that_half_closes_still_gets_its_whole_reply(impatient_server, smollm):
    expected = plain_text(smollm, chat_tokens(smollm[1], QUESTION), 24)
    status, body = status_and_body(exchange(impatient_server, http_post(
        "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 24})))
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == expected
    status, body = status_and_body(exchange(impatient_server, http_post(
        "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 24, "stream": True})))
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]) == expected


def test_a_client_that_closes_before_a_plain_reply_cancels_it(impatient_server):
    import socket

    before = raw(impatient_server, "GET", "/health")[1]["cancelled"]
    connection = socket.create_connection(impatient_server)
    connection.sendall(http_post("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "Write a very long story about a dragon."}], "max_tokens": 2000}))
    connection.close()
    deadline = time.monotonic() + 120
    while raw(impatient_server, "GET", "/health")[1]["cancelled"] == before:
        assert time.monotonic() < deadline, "the generation went on without its client"
        time.sleep(0.2)


ODD_REQUESTS = {
    "a Content-Length of superscript two": (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                            b"Content-Type: application/json\r\nContent-Length: \xb2\r\n\r\n{}", 400),
    "a Content-Length of 4,400 digits": (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: "
                                         + b"9" * 4400 + b"\r\n\r\n{}", 400),
    "a negative Content-Length": (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: -5\r\n\r\n",
                                  400),
    "a body cut short": (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b" " * 70, 400),
    "a garbage request line": (b"\x00\x01 hello there\r\n\r\n", 400),
    "a header line of 70,000 bytes": (b"GET /health HTTP/1.1\r\nHost: localhost\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
                                      431),
    "200 headers": (b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + b"X: y\r\n" * 200 + b"\r\n", 431),
    "HTTP/3.0": (b"GET /health HTTP/3.0\r\nHost: localhost\r\n\r\n", 505),
}


@pytest.mark.parametrize("case", list(ODD_REQUESTS))
def test_odd_requests_get_a_json_4xx(impatient_server, case):
    data, status = ODD_REQUESTS[case]
    got, body = status_and_body(exchange(impatient_server, data))
    assert got == status and json.loads(body)["error"]["message"], body[:200]


def test_a_body_that_stops_arriving_gets_408_not_500(impatient_server):
    import socket

    with socket.create_connection(impatient_server, timeout=30) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1000\r\n\r\n" + b" " * 70)  # then silence, the socket left open
        tic = time.monotonic()
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    got, body = status_and_body(received)
    assert got == 408 and "stopped arriving" in json.loads(body)["error"]["message"]
    assert time.monotonic() - tic < 20
    assert raw(impatient_server, "GET", "/health")[0] == 200


def test_a_burst_of_clients_each_gets_an_answer_not_a_reset(server):
    """64 clients at one instant (a gateway, an agent fanning out sub-agents): each gets a 200
    or a 429, none a reset (the listen backlog holds the burst, so the queue decides)."""
    barrier, statuses = threading.Barrier(64), []

    def call(index):
        body = {"messages": [{"role": "user", "content": f"Say {index}."}], "max_tokens": 1} if index % 2 else \
            {"model": "m", "messages": [{"role": "user", "content": "Count me."}]}
        path = "/v1/chat/completions" if index % 2 else "/v1/messages/count_tokens"
        barrier.wait()
        try:
            statuses.append(raw(server, "POST", path, json.dumps(body).encode())[0])
        except OSError as error:  # a reset, a refusal
            statuses.append(repr(error))

    threads = [threading.Thread(target=call, args=(index,)) for index in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(statuses) == 64 and set(statuses) <= {200, 429}, statuses


def test_past_the_queue_a_request_gets_429_and_a_queued_stream_hears_keep_alives(smollm):
    """One seat and one place in the queue: a streamed request waiting for the seat hears
    SSE comments, the next one gets a 429 with Retry-After in OpenAI's error shape, and
    once the first two leave the server answers again with plain decoding's text."""
    process, address = start_server("--draft", "none", "--max-concurrency", "1", "--max-queue", "1")
    try:
        def streamed(messages, max_tokens):
            connection = http.client.HTTPConnection(*address, timeout=120)
            connection.request("POST", "/v1/chat/completions", body=json.dumps(
                {"messages": messages, "max_tokens": max_tokens, "stream": True}),
                headers={"Content-Type": "application/json"})
            return connection, connection.getresponse()

        story = [{"role": "user", "content": "Write a very long story about a dragon."}]
        first, replying = streamed(story, 2000)
        while not replying.fp.readline().startswith(b"data:"):
            pass
        second, waiting = streamed(QUESTION, 8)
        assert waiting.status == 200
        line = waiting.fp.readline()
        while not line.startswith(b":"):  # (the role's delta comes at once)
            assert b'"content": ""' in line or not line.strip(), line
            line = waiting.fp.readline()
        assert line == b": waiting for a seat\n"
        status, body = raw(address, "POST", "/v1/chat/completions", json.dumps({"messages": QUESTION}).encode())
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
        connection = http.client.HTTPConnection(*address, timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi"}),
                           headers={"Content-Type": "application/json"})
        # (no reply has finished yet: estimated from the prior time per reply, not 0 s)
        assert int(connection.getresponse().getheader("Retry-After")) >= REPLY_SECONDS_PRIOR
        for connection, response in ((second, waiting), (first, replying)):
            response.close()
            connection.close()
        deadline = time.monotonic() + 120
        while True:  # the departed clients' requests are dropped between rounds
            status, body = raw(address, "POST", "/v1/chat/completions",
                               json.dumps({"messages": QUESTION, "max_tokens": 12}).encode())
            if status == 200:
                break
            assert status == 429 and time.monotonic() < deadline
            time.sleep(0.5)
        assert body["choices"][0]["message"]["content"] == plain_text(smollm, chat_tokens(smollm[1], QUESTION), 12)
    finally:
        process.terminate()
        process.communicate(timeout=30)
