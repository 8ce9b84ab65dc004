"""An agent's tool loop against three OpenAI-compatible servers on this machine, side by
side: mlx-lm's own (``python -m mlx_lm.server``), ours with default settings and ours with
``--draft none`` (plain decoding through our loop); also ``ours-rows``, ``ours-no-ride`` and ``ours-own-odds``,
ours with one of the batch's levers off (benchmarks/levers.py).

    python benchmarks/agent.py [--model GGUF_OR_DIR] [--tasks 4] [--max-tokens 160]
        [--servers mlx-lm,ours,ours-none] [--out benchmarks/results/agent.json]

The workload is this file's own: a coding assistant with a system prompt and three tools
(``read_file``, ``write_file``, ``run_tests``) over a small fake project, and tasks that
read, explain, edit and test it. Each task runs as an agent runs it: a request with the
tools; a reply that calls tools gets their results (from the fake project, the same for
every server) and a next request; until a reply calls none, or four requests. Every
server's client gives calls the same ids, so the prompts stay comparable; a reply that
writes a call as bare JSON (small models do) is read as that call on the client side for
mlx-lm's server, as ours reads it (mlx_eagle/replies.py). Tasks rotate which server goes
first. Greedy; all servers get OpenBLAS on Linux.

Then structured replies (``response_format`` json_schema: a file's functions, an edit as
search/replace, a test report), to ours with and without drafting only: mlx-lm's server has
no structured outputs.

Reported: whether the transcripts are identical across servers; the tool loop's total time
and its ratio to mlx-lm's; the structured replies' time against plain constrained decoding;
per request kind (a reply that calls tools, an answer after tool results, a JSON-schema
reply) the time, tokens and, for ours, the tokens drafted and accepted from each source.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from levers import LEVERS  # noqa: E402 (the sibling script's levers, wherever this one is loaded from)

from mlx_eagle.blas import find_openblas  # noqa: E402
from mlx_eagle.models import resolve_model  # noqa: E402
from mlx_eagle.replies import bare_calls  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SYSTEM = ("You are a coding assistant working in the user's project. Use the tools to read files before you "
          "answer questions about them, to write files when asked to change them (always write the whole "
          "file), and to run the tests. Keep answers short and quote code exactly.")
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file of the project with new content.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the project's tests and return their output.",
        "parameters": {"type": "object", "properties": {}}}},
]
PROJECT = {
    "utils.py": ("import re\n\n\ndef slugify(title):\n    \"\"\"A URL-safe slug of a title.\"\"\"\n"
                 "    words = re.findall(r\"[a-z0-9]+\", title.lower())\n    return \"-\".join(words)\n\n\n"
                 "def word_count(text):\n    return len(text.split())\n"),
    "test_utils.py": ("from utils import slugify, word_count\n\n\ndef test_slugify():\n"
                      "    assert slugify(\"Hello, World!\") == \"hello-world\"\n\n\ndef test_word_count():\n"
                      "    assert word_count(\"one two  three\") == 3\n"),
}
TASKS = [
    "Read utils.py and explain what slugify does.",
    "Read utils.py, then rename the function word_count to count_words and write the whole file back.",
    "Run the tests and tell me whether they pass.",
    "Read test_utils.py and show me the test for slugify.",
]

# Structured replies an agent asks for (response_format json_schema): a test report, a file's
# functions, an edit as search/replace. mlx-lm's server has no response_format (it ignores
# the field), so these go to ours only: default drafting against plain constrained decoding.
JSON_TASKS = [
    ("Report this test run.\n\n" + "test_utils.py::test_slugify PASSED\ntest_utils.py::test_word_count PASSED\n"
     "2 passed in 0.01s",
     {"type": "object", "properties": {"passed": {"type": "integer"}, "failed": {"type": "integer"},
                                       "tests": {"type": "array", "items": {
                                           "type": "object", "properties": {
                                               "file": {"type": "string"}, "name": {"type": "string"},
                                               "status": {"enum": ["PASSED", "FAILED"]}},
                                           "required": ["file", "name", "status"], "additionalProperties": False}}},
      "required": ["passed", "failed", "tests"], "additionalProperties": False}),
    ("List every function of utils.py with its parameters and its whole source code.\n\nutils.py:\n"
     + PROJECT["utils.py"],
     {"type": "object", "properties": {"functions": {"type": "array", "items": {
         "type": "object", "properties": {"name": {"type": "string"},
                                          "parameters": {"type": "array", "items": {"type": "string"}},
                                          "source": {"type": "string"}},
         "required": ["name", "parameters", "source"], "additionalProperties": False}}},
      "required": ["functions"], "additionalProperties": False}),
    ("Rename word_count to count_words in utils.py. Give the edit as the exact text to search for and its "
     "replacement.\n\nutils.py:\n" + PROJECT["utils.py"],
     {"type": "object", "properties": {"path": {"type": "string"}, "search": {"type": "string"},
                                       "replace": {"type": "string"}},
      "required": ["path", "search", "replace"], "additionalProperties": False})
]
JSON_KIND = "JSON-schema reply"


def run_tool(name: str, arguments: dict) -> str:
    """The fake project's answer to a call, the same for every server."""
    if name == "read_file":
        return PROJECT.get(str(arguments.get("path")), f"error: no file {arguments.get('path')!r}")
    if name == "write_file":
        return f"wrote {len(str(arguments.get('content', '')))} characters to {arguments.get('path')}"
    if name == "run_tests":
        return "test_utils.py::test_slugify PASSED\ntest_utils.py::test_word_count PASSED\n2 passed in 0.01s"
    return f"error: no tool {name!r}"


def start(kind: str, model_dir: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ)
    library = find_openblas()
    if library and kind == "mlx-lm":  # ours restarts itself with it; mlx-lm's needs it given
        env["LD_PRELOAD"] = library
    if kind == "mlx-lm":
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
    else:  # ours, ours-none (--draft none), or ours-<lever>: one of the batch's levers off (levers.py)
        lever = kind.removeprefix("ours-")
        server = [str(HERE / "levers.py"), lever] if lever in LEVERS else ["-m", "mlx_eagle.server"]
        command = [sys.executable, *server, "--model", str(model_dir), "--port", str(port), "--quiet"] \
            + (["--draft", "none"] if kind == "ours-none" else [])
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)


def wait_ready(client: openai.OpenAI, process: subprocess.Popen, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"error: a server exited with {process.returncode} before it answered")
        try:
            client.with_options(timeout=5).chat.completions.create(
                model="default_model", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            return
        except (openai.APIConnectionError, openai.APITimeoutError):
            time.sleep(1)
    raise SystemExit("error: a server did not answer in time")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(Path.home() / ".cache/mlx-eagle/gguf/"
                                              "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
                        help="a GGUF or model directory (default: Qwen2.5-Coder-0.5B-Instruct, from "
                        "benchmarks/qwen_models.py)")


@contextmanager
def servers(kinds: List[str], model_dir: Path, port: int, timeout: float = 1800) -> Iterator[Dict[str, openai.OpenAI]]:
    """A client for each kind's server, started on consecutive ports from ``port`` and
    answering; the servers stop on leaving."""
    processes, clients = {}, {}
    try:
        for offset, kind in enumerate(kinds):
            processes[kind] = start(kind, model_dir, port + offset)
            clients[kind] = openai.OpenAI(base_url=f"http://127.0.0.1:{port + offset}/v1", api_key="local",
                                          max_retries=0, timeout=timeout)
        for kind in kinds:
            wait_ready(clients[kind], processes[kind])
        yield clients
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(timeout=60)


def calls_of(message) -> List[Tuple[str, dict]]:
    """(name, arguments) of a reply's calls: its tool_calls, else a bare-JSON call in its text."""
    if message.tool_calls:
        return [(c.function.name, json.loads(c.function.arguments or "{}")) for c in message.tool_calls]
    found = bare_calls(message.content or "", TOOLS)
    return [(c.name, json.loads(c.arguments)) for c in found] if found else []


def run_task(client: openai.OpenAI, task: str, max_tokens: int) -> Tuple[List[dict], List[dict]]:
    """The transcript (what the model wrote, request by request) and each request's figures."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    transcript, requests = [], []
    for _ in range(4):
        tic = time.perf_counter()
        reply = client.chat.completions.create(model="default_model", messages=messages, tools=TOOLS,
                                               max_tokens=max_tokens, temperature=0)
        seconds = time.perf_counter() - tic
        message = reply.choices[0].message
        calls = calls_of(message)
        speculation = (reply.usage.model_extra or {}).get("speculation") or {}
        requests.append({"kind": "tool call" if calls else ("answer after tool results" if len(messages) > 2
                                                             else "answer"),
                         "seconds": seconds, "tokens": reply.usage.completion_tokens,
                         "cached_tokens": (reply.usage.prompt_tokens_details.cached_tokens
                                           if reply.usage.prompt_tokens_details else None),
                         "drafters": speculation.get("drafters", {})})
        content = "" if calls else (message.content or "")
        transcript.append({"content": content, "calls": calls})
        if not calls:
            break
        ids = [f"call_{len(messages)}_{i}" for i in range(len(calls))]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in zip(ids, calls)]})
        messages += [{"role": "tool", "tool_call_id": i, "content": run_tool(n, a)} for i, (n, a) in zip(ids, calls)]
    return transcript, requests


def run_json_task(client: openai.OpenAI, task: str, schema: dict, max_tokens: int) -> Tuple[List[dict], List[dict]]:
    """One structured reply: its text, and the request's figures."""
    tic = time.perf_counter()
    reply = client.chat.completions.create(
        model="default_model", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}})
    seconds = time.perf_counter() - tic
    speculation = (reply.usage.model_extra or {}).get("speculation") or {}
    return [{"content": reply.choices[0].message.content, "calls": []}], [
        {"kind": JSON_KIND, "seconds": seconds, "tokens": reply.usage.completion_tokens,
         "cached_tokens": None, "drafters": speculation.get("drafters", {})}]


def summary(requests: List[dict]) -> Dict[str, dict]:
    kinds: Dict[str, dict] = {}
    for r in requests:
        k = kinds.setdefault(r["kind"], {"requests": 0, "seconds": 0.0, "tokens": 0, "drafters": {}})
        k["requests"] += 1
        k["seconds"] += r["seconds"]
        k["tokens"] += r["tokens"]
        for name, stats in r["drafters"].items():
            d = k["drafters"].setdefault(name, {"proposed": 0, "accepted": 0})
            d["proposed"] += stats["proposed"]
            d["accepted"] += stats["accepted"]
    return kinds


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--tasks", type=int, default=len(TASKS), help="tool-loop tasks to run")
    parser.add_argument("--json-tasks", type=int, default=len(JSON_TASKS), help="structured-reply tasks to run")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--servers", default="mlx-lm,ours,ours-none")
    parser.add_argument("--port", type=int, default=8391, help="the first of three consecutive ports")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "agent.json")
    args = parser.parse_args(argv)
    kinds = args.servers.split(",")
    model_dir = resolve_model(args.model)  # a GGUF is converted once, as --model converts it
    with servers(kinds, model_dir, args.port) as clients:
        transcripts = {kind: [] for kind in kinds}
        requests = {kind: [] for kind in kinds}
        for index, task in enumerate(TASKS[:args.tasks]):
            order = kinds[index % len(kinds):] + kinds[:index % len(kinds)]
            for kind in order:
                transcript, figures = run_task(clients[kind], task, args.max_tokens)
                transcripts[kind].append(transcript)
                requests[kind] += figures
            print(f"task {index + 1}/{args.tasks}: " + ", ".join(
                f"{k} {sum(r['seconds'] for r in requests[k][-len(transcripts[k][-1]):]):.1f} s" for k in kinds),
                file=sys.stderr)
        ours = [kind for kind in kinds if kind != "mlx-lm"]
        json_transcripts = {kind: [] for kind in ours}
        for index, (task, schema) in enumerate(JSON_TASKS[:args.json_tasks]):
            for kind in ours[index % len(ours):] + ours[:index % len(ours)]:
                transcript, figures = run_json_task(clients[kind], task, schema, args.max_tokens)
                json_transcripts[kind].append(transcript)
                requests[kind] += figures
            print(f"JSON task {index + 1}/{args.json_tasks}: " + ", ".join(
                f"{k} {requests[k][-1]['seconds']:.1f} s" for k in ours), file=sys.stderr)
    loop = {kind: [r for r in requests[kind] if r["kind"] != JSON_KIND] for kind in kinds}
    totals = {kind: sum(r["seconds"] for r in loop[kind]) for kind in kinds}
    reference = "mlx-lm" if "mlx-lm" in kinds else kinds[0]
    structured = {kind: sum(r["seconds"] for r in requests[kind] if r["kind"] == JSON_KIND) for kind in ours}
    result = {
        "model": str(model_dir), "tasks": args.tasks, "json_tasks": args.json_tasks, "max_tokens": args.max_tokens,
        "identical": all(transcripts[k] == transcripts[reference] for k in kinds),
        "json_identical": all(json_transcripts[k] == json_transcripts[ours[0]] for k in ours) if ours else None,
        "seconds": totals,
        "speedup_vs_" + reference: {k: totals[reference] / totals[k] if totals[k] else None for k in kinds},
        "json_seconds": structured,
        "by_kind": {kind: summary(requests[kind]) for kind in kinds},
        "requests": requests, "transcripts": transcripts[reference],
        "json_transcripts": json_transcripts[ours[0]] if ours else [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"identical transcripts: tool loop {result['identical']}, JSON-schema replies {result['json_identical']}")
    print(f"{'server':10} {'tool loop s':>11} {'vs ' + reference:>10}")
    for kind in kinds if args.tasks else []:
        print(f"{kind:10} {totals[kind]:11.1f} {totals[reference] / totals[kind]:9.2f}x")
    if "ours" in structured and "ours-none" in structured and structured["ours"]:
        print(f"JSON-schema replies: ours {structured['ours']:.1f} s, ours-none {structured['ours-none']:.1f} s: "
              f"{structured['ours-none'] / structured['ours']:.2f}x plain constrained decoding")
    for kind in kinds:
        for name, k in result["by_kind"][kind].items():
            drafted = ", ".join(f"{d}: {s['accepted']}/{s['proposed']}" for d, s in k["drafters"].items())
            print(f"{kind:10} {name:26} {k['requests']:2} requests {k['tokens']:5} tokens {k['seconds']:7.1f} s"
                  + (f"  drafted (accepted/proposed) {drafted}" if drafted else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
