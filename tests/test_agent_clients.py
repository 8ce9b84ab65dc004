"""The real agent clients, end to end, as their users start them: Claude Code from npm against
the server on Qwen2.5-Coder-0.5B-Instruct, asked to read a file with its Read tool. The call
must reach the client's tool, its result must come back to the model, and the turn must end
with no API error. Skipped, with one line, where npm or the client cannot be had."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real model in a server process, and a client from npm
ROOT = Path(__file__).resolve().parent.parent
SYSTEM = ("You are a coding agent. Call a tool when the user asks for it. Once a tool's result has come back, "
          "do not call it again: answer the user in one plain sentence.")


def npm_client(package: str, name: str) -> Path:
    """``name``'s binary from the npm ``package``, installed once into the user's cache."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed, so {package} cannot be had here")
    prefix = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-eagle" / "clients" / name
    binary = prefix / "bin" / name
    if not binary.exists():
        done = subprocess.run([npm, "install", "-g", "--prefix", str(prefix), package], capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0 or not binary.exists():
            pytest.skip(f"{package} could not be installed from npm: {(done.stderr or '').strip()[-200:]}")
    return binary


@pytest.fixture(scope="module")
def qwen_server(qwen_coder_gguf):
    """``python -m mlx_eagle.server`` on Qwen2.5-Coder-0.5B, as a user starts it; its base URL."""
    process = subprocess.Popen([sys.executable, "-m", "mlx_eagle.server", "--model", str(qwen_coder_gguf),
                                "--port", "0", "--quiet"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                               stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            break
    else:
        raise AssertionError("the server did not start")
    yield found.group(1)
    process.terminate()
    process.communicate(timeout=30)


def run_claude(claude: Path, server: str, workdir: Path, task: str) -> list:
    """``claude -p task`` as its users start it against a local server (a local model name),
    with one tool and a short system prompt: its own 24 tools' 27k-token prompt takes 10
    minutes to read on a 2-core CPU. Its stream-json events."""
    env = dict(os.environ, ANTHROPIC_BASE_URL=server, ANTHROPIC_API_KEY="local", ANTHROPIC_MODEL="qwen-local",
               ANTHROPIC_SMALL_FAST_MODEL="qwen-local", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               CLAUDE_CODE_MAX_OUTPUT_TOKENS="64", HOME=str(workdir))
    done = subprocess.run([str(claude), "-p", task, "--tools", "Read", "--system-prompt", SYSTEM,
                           "--output-format", "stream-json", "--verbose"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=900)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert any(event.get("type") == "result" for event in events), done.stdout[-2000:] + done.stderr[-2000:]
    return events


def blocks(events: list, role: str, kind: str) -> list:
    return [block for event in events if event.get("type") == role
            for block in event["message"]["content"] if isinstance(block, dict) and block.get("type") == kind]


def test_claude_code_answers_and_its_tool_calls_reach_its_tools(qwen_server, tmp_path):
    claude = npm_client("@anthropic-ai/claude-code", "claude")
    (result,) = [e for e in run_claude(claude, qwen_server, tmp_path, "What is 2 + 2? Answer with the number only.")
                 if e.get("type") == "result"]
    assert not result["is_error"] and "4" in result["result"], result
    (tmp_path / "notes.txt").write_text("The secret number is 4172.\n")
    events = run_claude(claude, qwen_server, tmp_path, "Use the Read tool to read notes.txt, then tell me the "
                                                       "secret number.")
    calls, results = blocks(events, "assistant", "tool_use"), blocks(events, "user", "tool_result")
    assert calls and calls[0]["name"] == "Read", events
    assert results and "4172" in json.dumps(results[0]["content"])  # the tool ran, its result went back
    (result,) = [event for event in events if event.get("type") == "result"]
    # (Qwen2.5-Coder-0.5B then repeats its call as text until the reply's bound: the model's, not an API error.)
    assert not result["is_error"] or "output token maximum" in result["result"], result
