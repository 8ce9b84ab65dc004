"""Real agent clients' sessions against the server, as their users start them: Claude Code and
Codex CLI from npm, the OpenAI Agents SDK and aider from PyPI, each installed once into the
user's cache (``~/.cache/mlx-eagle/clients/NAME``), each given a scripted task that makes
the model use a tool (read a named file and tell its secret; aider: fix a function).

For each client, on a fresh server: two sessions in a row, then one more after the server is
restarted, with the prompt cache features on (the defaults) and off (``--prompt-cache-bytes 0
--prompt-disk-bytes 0``). Per request (the server's ``--log-requests`` lines): the prompt's
tokens, the tokens read (not served by a cache) and the time to first token; per session,
whether the client finished with no API error and whether a tool call reached its tool.

    python benchmarks/agent_clients.py [--model GGUF] [--clients claude,codex,agents,aider]
        [--cache on,off] [--out benchmarks/results/agent_clients.json]

The clients run with small settings where their defaults take minutes to read on a 2-core
CPU (40-50 tokens/s): Claude Code with ``--tools Read`` and a short ``--system-prompt`` (its
24 tools are 27k tokens), Codex with a short ``model_instructions_file``, web search and
sub-agents off (1.8k tokens against 6-9k). Codex's server bounds replies (``--max-tokens``,
``SERVER_FLAGS``): Codex sends no bound, and the 0.5B model may write to the end of its
context. Each client's sessions run in one project directory, as a user's do. The prompt
store lives in a directory of this run's (``MLX_EAGLE_CACHE``), the converted model is the
user's. A table on standard output, the JSON in ``--out``.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import venv
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import add_model_argument  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECRET = "4172"
INSTRUCTIONS = ("You are a coding agent. Call a tool when the user asks for it. Once a tool's result has come "
                "back, do not call it again: answer the user in one plain sentence.")
READ_TASK = "Use the Read tool to read notes.txt, then tell me the secret number."
CLIENT_SECONDS = 900  # one session, first prompt read included


class Unavailable(Exception):
    """A client that cannot be installed here (no npm, no network): one line saying why."""


def clients_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-eagle" / "clients"


def npm_client(package: str, name: str) -> Path:
    """``name``'s binary from the npm ``package``, installed once into the user's cache."""
    npm = shutil.which("npm")
    if npm is None:
        raise Unavailable(f"npm is not installed, so {package} cannot be had here")
    prefix = clients_dir() / name
    binary = prefix / "bin" / name
    if not binary.exists():
        done = subprocess.run([npm, "install", "-g", "--prefix", str(prefix), package], capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0 or not binary.exists():
            raise Unavailable(f"{package} could not be installed from npm: {(done.stderr or '').strip()[-200:]}")
    return binary


def pip_client(package: str, name: str, module: str) -> Path:
    """A virtual environment of its own with the PyPI ``package`` (importing ``module``),
    made once in the user's cache; its bin directory."""
    prefix = clients_dir() / name
    python = prefix / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", f"import {module}"],
                                             capture_output=True).returncode != 0:
        venv.create(prefix, with_pip=True, clear=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", package], capture_output=True,
                              text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(prefix, ignore_errors=True)
            raise Unavailable(f"{package} could not be installed from PyPI: {(done.stderr or '').strip()[-200:]}")
    return python.parent


class Server:
    """``python -m mlx_eagle.server`` as a user starts it, with ``--log-requests``: its base
    URL and the JSON lines of the requests it has answered."""

    def __init__(self, model: str, *flags: str, cache: Optional[Path] = None):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if cache is not None:
            env["MLX_EAGLE_CACHE"] = str(cache)
        self.process = subprocess.Popen([sys.executable, "-m", "mlx_eagle.server", "--model", str(model),
                                         "--port", "0", "--log-requests", *flags], cwd=ROOT, env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: List[dict] = []
        for line in self.process.stderr:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            if found:
                self.url = found.group(1)
                break
        else:
            raise RuntimeError(f"the server exited with {self.process.wait()} before it served")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def requests(self, since: int = 0) -> List[dict]:
        """The generations answered since the ``since``-th logged line (not probes or counts)."""
        return [line for line in self.lines[since:] if "prompt_tokens" in line]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self._reader.join(timeout=10)


@dataclass
class Session:
    """One session of a client: whether it ended with no API error, whether the model called
    a tool and the tool's result went back to it, what the client said last."""

    ok: bool
    tool_called: bool
    result_returned: bool
    said: str
    requests: List[dict] = field(default_factory=list)


def write_project(workdir: Path) -> None:
    (workdir / "notes.txt").write_text(f"The secret number is {SECRET}.\n")
    (workdir / "calc.py").write_text("def add(a, b):\n    return a - b\n")


def run_claude(url: str, workdir: Path, model: str = "qwen-local") -> Session:
    """``claude -p`` with its Read tool and a short system prompt, under a local model name
    (or a ``claude-*`` one, with which Claude Code sends other fields)."""
    claude = npm_client("@anthropic-ai/claude-code", "claude")
    env = dict(os.environ, ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="local", ANTHROPIC_MODEL=model,
               ANTHROPIC_SMALL_FAST_MODEL=model, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               CLAUDE_CODE_MAX_OUTPUT_TOKENS="64", HOME=str(workdir))
    done = subprocess.run([str(claude), "-p", READ_TASK, "--tools", "Read", "--system-prompt", INSTRUCTIONS,
                           "--output-format", "stream-json", "--verbose"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=CLIENT_SECONDS)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    results = [event for event in events if event.get("type") == "result"]
    if not results:
        return Session(False, False, False, (done.stdout + done.stderr)[-500:])
    result = results[-1]

    def blocks(role: str, kind: str) -> list:
        return [block for event in events if event.get("type") == role
                for block in event["message"]["content"] if isinstance(block, dict) and block.get("type") == kind]

    calls, outputs = blocks("assistant", "tool_use"), blocks("user", "tool_result")
    # A reply cut at its bound is the model's length, not an API error.
    ok = not result["is_error"] or "output token maximum" in str(result.get("result"))
    # (The result went back whatever the model asked of the tool: a path it made up gets an error.)
    return Session(ok, bool(calls), bool(outputs), str(result.get("result"))[-300:])


CODEX_CONFIG = """model = "qwen-local"
model_provider = "local"
model_instructions_file = "{instructions}"
web_search = "disabled"

[agents]
enabled = false

[features]
goals = false

[model_providers.local]
name = "local"
base_url = "{url}/v1"
env_key = "LOCAL_API_KEY"
wire_api = "responses"
"""


def run_codex(url: str, workdir: Path) -> Session:
    """``codex exec --json`` with a short ``model_instructions_file``, web search and
    sub-agents off, full access (its sandbox needs namespaces a container may lack)."""
    codex = npm_client("@openai/codex", "codex")
    home = workdir / ".codex"
    home.mkdir(exist_ok=True)
    (home / "instructions.md").write_text("You are Codex, a coding agent. To run a shell command, call the "
                                          "exec_command function. " + INSTRUCTIONS.split(". ", 1)[1])
    (home / "config.toml").write_text(CODEX_CONFIG.format(instructions=home / "instructions.md", url=url))
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "--json", "-s", "danger-full-access",
                           "Run cat notes.txt and tell me the secret number."], cwd=workdir,
                          env=dict(os.environ, CODEX_HOME=str(home), LOCAL_API_KEY="local", HOME=str(workdir)),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLIENT_SECONDS)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    items = [event["item"] for event in events if event.get("type") == "item.completed"]
    # Not API errors: Codex's warning of its own (no catalog entry for a local model's name),
    # and its report of a reply cut at the server's bound (the model's length).
    errors = [item["message"] for item in items if item["type"] == "error" and "Model metadata" not in item["message"]]
    errors += [json.dumps(event) for event in events if event.get("type") in ("turn.failed", "error")
               and "reason: max_output_tokens" not in json.dumps(event)]
    commands = [item for item in items if item["type"] == "command_execution"]
    said = [item["text"] for item in items if item["type"] == "agent_message"]
    completed = any(event.get("type") in ("turn.completed", "turn.failed") for event in events)
    return Session(completed and not errors, bool(commands),
                   bool(commands) and completed,
                   ("; ".join(errors) or (said[-1] if said else done.stderr))[-300:])


AGENTS_SCRIPT = r'''
import json, sys
from pathlib import Path
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from agents.items import ToolCallOutputItem
from openai import AsyncOpenAI

url, workdir, task, instructions = sys.argv[1:5]
set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=url + "/v1", api_key="local"))
calls = []


@function_tool
def read_file(path: str) -> str:
    """Read a text file and return its contents."""
    calls.append(path)
    return (Path(workdir) / path).read_text()


agent = Agent(name="coder", instructions=instructions, tools=[read_file], model="qwen-local",
              model_settings=ModelSettings(max_tokens=200))
try:
    result = Runner.run_sync(agent, task, max_turns=4)
    returned = any(isinstance(item, ToolCallOutputItem) for item in result.new_items)
    print(json.dumps({"calls": calls, "returned": returned, "said": str(result.final_output), "ok": True}))
except (MaxTurnsExceeded, ModelBehaviorError) as error:
    # The model calling again and again, or writing to its bound (the SDK's error for a reply
    # cut at max_tokens): its behaviour, not an API error. A call before it went back.
    length = isinstance(error, MaxTurnsExceeded) or "max_output_tokens" in str(error)
    print(json.dumps({"calls": calls, "returned": len(calls) > 0, "said": str(error), "ok": length}))
'''


def run_agents_sdk(url: str, workdir: Path) -> Session:
    """``Runner.run_sync`` of an agent with one function tool, on the Responses API."""
    bin_dir = pip_client("openai-agents", "agents", "agents")
    done = subprocess.run([str(bin_dir / "python"), "-c", AGENTS_SCRIPT, url, str(workdir),
                           READ_TASK.replace("the Read tool", "read_file"), INSTRUCTIONS], cwd=workdir,
                          capture_output=True, text=True, timeout=CLIENT_SECONDS)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return Session(False, False, False, done.stderr.strip()[-300:])
    said = json.loads(lines[-1])
    return Session(said["ok"], bool(said["calls"]), said["returned"], said["said"][-300:])


def run_aider(url: str, workdir: Path) -> Session:
    """``aider --message`` on calc.py through the OpenAI-compatible chat completions: its
    tool is the edit it applies to the file."""
    bin_dir = pip_client("aider-chat", "aider", "aider")
    before = (workdir / "calc.py").read_text()
    done = subprocess.run([str(bin_dir / "aider"), "--model", "openai/qwen-local", "--openai-api-base", url + "/v1",
                           "--openai-api-key", "local", "--message",
                           "The add function in calc.py returns a - b. Change it to return a + b.", "--yes-always",
                           "--no-git", "--no-show-model-warnings", "--no-check-update", "--no-analytics", "--no-pretty",
                           "calc.py"], cwd=workdir, env=dict(os.environ, HOME=str(workdir)),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLIENT_SECONDS)
    output = done.stdout + done.stderr
    errors = re.findall(r"litellm\.\w*Error[^\n]*|Error code: \d+[^\n]*", output)
    edited = (workdir / "calc.py").read_text() != before
    return Session(done.returncode == 0 and not errors, edited, edited, ("; ".join(errors) or output)[-300:])


CLIENTS: Dict[str, Callable[[str, Path], Session]] = {
    "claude": run_claude, "codex": run_codex, "agents": run_agents_sdk, "aider": run_aider}
CACHE_FLAGS = {"on": [], "off": ["--prompt-cache-bytes", "0", "--prompt-disk-bytes", "0"]}
SERVER_FLAGS = {"codex": ["--max-tokens", "512"]}  # the others send a bound, or (aider) end by themselves


def private_cache(directory: Path) -> Path:
    """A cache directory whose prompt store is this run's, its converted models the user's."""
    from mlx_eagle.files import cache_dir

    directory.mkdir(parents=True, exist_ok=True)
    for entry in cache_dir().iterdir() if cache_dir().exists() else []:
        if entry.name not in ("prompts", "clients"):
            (directory / entry.name).symlink_to(entry)
    return directory


def sessions(client: str, model: str, cache: str, scratch: Path) -> List[dict]:
    """Two sessions on a fresh server, then one on the same server restarted."""
    store = private_cache(scratch / f"{client}-{cache}-cache")
    workdir = scratch / f"{client}-{cache}-project"
    workdir.mkdir()
    rows, server = [], None
    for name in ("first", "second", "after restart"):
        if server is None:
            server = Server(model, *SERVER_FLAGS.get(client, []), *CACHE_FLAGS[cache], cache=store)
        write_project(workdir)
        since, started = len(server.lines), time.monotonic()
        try:
            session = CLIENTS[client](server.url, workdir)
        except BaseException:
            server.stop()
            raise
        seconds = time.monotonic() - started
        time.sleep(0.5)  # the last request's log line
        session.requests = [{"prompt_tokens": r["prompt_tokens"], "read": r["prompt_tokens"] - r["cached_tokens"],
                             "time_to_first_token": r["time_to_first_token"], "status": r["status"]}
                            for r in server.requests(since)]
        rows.append({"session": name, "seconds": round(seconds, 1), **asdict(session)})
        print(f"{client:7s} cache {cache:3s} {name:14s} ok={session.ok} tool={session.tool_called} "
              f"result_back={session.result_returned} {seconds:6.1f} s  "
              + "  ".join(f"{r['read']}/{r['prompt_tokens']} read, {r['time_to_first_token']} s"
                          for r in session.requests), file=sys.stderr, flush=True)
        if name != "first":
            server.stop()
            server = None
    return rows


def table(results: Dict[str, Dict[str, List[dict]]]) -> str:
    lines = ["| client | cache | session | ok | tool called | result back | requests: read / prompt tokens, "
             "first token |", "|---|---|---|---|---|---|---|"]
    for client, by_cache in results.items():
        for cache, rows in by_cache.items():
            for row in rows:
                turns = "; ".join(f"{r['read']} / {r['prompt_tokens']}, {r['time_to_first_token']:.1f} s"
                                  for r in row["requests"] if r["time_to_first_token"] is not None)
                lines.append(f"| {client} | {cache} | {row['session']} | {row['ok']} | {row['tool_called']} | "
                             f"{row['result_returned']} | {turns} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"which of {', '.join(CLIENTS)}")
    parser.add_argument("--cache", default="on,off", help="the prompt cache features on (defaults), off, or both")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "agent_clients.json")
    args = parser.parse_args(argv)
    names, caches = args.clients.split(","), args.cache.split(",")
    unknown = [n for n in names if n not in CLIENTS] + [c for c in caches if c not in CACHE_FLAGS]
    if unknown:
        raise SystemExit(f"error: unknown {', '.join(unknown)}: --clients takes {', '.join(CLIENTS)}, "
                         "--cache takes on,off")
    results: Dict[str, Dict[str, List[dict]]] = {}
    skipped: Dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="agent-clients-") as scratch:
        for client in names:
            try:
                results[client] = {cache: sessions(client, args.model, cache, Path(scratch))
                                   for cache in caches}
            except Unavailable as reason:
                skipped[client] = str(reason)
                print(f"{client}: skipped: {reason}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "server_flags": SERVER_FLAGS, "results": results,
                                    "skipped": skipped}, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
