"""The real agent clients, end to end, as their users start them, against the server on
Qwen2.5-Coder-0.5B-Instruct: Claude Code (under a local model name and a ``claude-*`` one)
and Codex CLI from npm, and aider from PyPI, each given a task that asks for a tool
(benchmarks/agent_clients.py runs them, and says with what settings). The OpenAI Agents SDK's
sessions run in test_benchmarks.py, across a restart. Each session must end with no API
error printed by the client, and a tool call the model makes must reach the client's tool,
its result going back to the model. A client that cannot be installed is skipped, with one
line. One server for all, the clients one after another: a second server beside the suite's
other tests would hold memory this machine lacks. ``--max-tokens 160``: Codex sends no bound,
and a reply the 0.5B model writes to its bound (160 tokens hold a call with its arguments) is
the model's length, which the clients report without an API error."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from agent_clients import CLIENTS, Server, Unavailable, run_claude, write_project  # noqa: E402

pytestmark = pytest.mark.slow  # a real model in a server process, and clients from npm and PyPI


def test_the_real_clients_end_their_sessions_without_an_api_error_and_their_calls_reach_their_tools(
        qwen_coder_gguf, tmp_path):
    sessions = {**{name: run for name, run in CLIENTS.items() if name != "agents"},
                "claude (claude-* name)": lambda url, workdir: run_claude(url, workdir, model="claude-sonnet-4-5")}
    server = Server(qwen_coder_gguf, "--max-tokens", "160")
    ran, skipped = {}, {}
    try:
        for name, run in sessions.items():
            workdir = tmp_path / name.split()[0] / str(len(ran) + len(skipped))
            workdir.mkdir(parents=True)
            write_project(workdir)
            try:
                ran[name] = run(server.url, workdir)
            except Unavailable as reason:
                skipped[name] = str(reason)
    finally:
        server.stop()
    if not ran:
        pytest.skip("; ".join(skipped.values()))
    for name, session in ran.items():
        assert session.ok, (name, session.said)
        if session.tool_called:  # the call reached the tool (or aider's edit its file), its result went back
            assert session.result_returned, (name, session.said)
    if "claude" in ran:  # Qwen2.5-Coder-0.5B calls Read here (then repeats its call: the model's)
        assert ran["claude"].tool_called, ran["claude"].said
