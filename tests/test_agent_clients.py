"""The real agent clients, end to end, as their users start them, against the server on
Qwen2.5-Coder-0.5B-Instruct: Claude Code and Codex CLI from npm, the OpenAI Agents SDK and
aider from PyPI, each given a task that asks for a tool (benchmarks/agent_clients.py runs
them, and says with what settings). The session must end with no API error printed by the
client, and a tool call the model makes must reach the client's tool, its result going back
to the model. Skipped, with one line, where a client cannot be installed."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from agent_clients import CLIENTS, SERVER_FLAGS, Server, Unavailable, run_claude, write_project  # noqa: E402

pytestmark = pytest.mark.slow  # a real model in a server process, and clients from npm and PyPI


@pytest.fixture(scope="module")
def server_for(qwen_coder_gguf):
    """A client's server (``python -m mlx_eagle.server`` as a user starts it, with the flags
    the benchmark gives that client), started once for the clients that share its flags."""
    started = {}

    def server(client: str) -> Server:
        flags = tuple(SERVER_FLAGS.get(client, ()))
        if flags not in started:
            started[flags] = Server(qwen_coder_gguf, *flags)
        return started[flags]

    yield server
    for running in started.values():
        running.stop()


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_real_client_ends_its_session_without_an_api_error_and_its_tool_calls_reach_its_tools(
        client, server_for, tmp_path):
    write_project(tmp_path)
    try:
        session = CLIENTS[client](server_for(client).url, tmp_path)
    except Unavailable as reason:
        pytest.skip(str(reason))
    assert session.ok, session.said
    if session.tool_called:  # the call reached the tool (or aider's edit its file), its result went back
        assert session.result_returned, session.said
    if client == "claude":  # Qwen2.5-Coder-0.5B calls Read here (then repeats its call: the model's)
        assert session.tool_called, session.said


def test_claude_code_under_a_claude_model_name_ends_its_session_without_an_api_error(server_for, tmp_path):
    """With a ``claude-*`` name Claude Code sends ``thinking`` of type ``enabled`` with a
    budget, and no system message among ``messages``: served the same."""
    write_project(tmp_path)
    try:
        session = run_claude(server_for("claude").url, tmp_path, model="claude-sonnet-4-5")
    except Unavailable as reason:
        pytest.skip(str(reason))
    assert session.ok, session.said
    if session.tool_called:
        assert session.result_returned, session.said
