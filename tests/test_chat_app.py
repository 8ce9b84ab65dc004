"""The terminal chat app, driven in a pseudo-terminal as a person would: a streamed
answer with a stats line, a follow-up that sees the earlier turn, Ctrl-C mid-answer
back to the prompt, /save, /reset, /quit and Ctrl-D."""

import json
import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

from mlx_eagle.heads import new_head, save_head

pytestmark = pytest.mark.slow  # the app in a terminal with the real SmolLM2

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def random_head(tmp_path_factory, smollm):
    """A random EAGLE-3 head, so the app's replies go through speculation."""
    model, _ = smollm
    path = tmp_path_factory.mktemp("head") / "random-eagle3"
    save_head(new_head(model, "eagle3", seed=5), path)
    return path


class Terminal:
    """The app on the slave side of a pty; we type on the master side."""

    def __init__(self, *args: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so ^C is SIGINT
            os.chdir(ROOT)
            env = dict(os.environ, TERM="dumb", PYTHONPATH=str(ROOT))
            os.execve(sys.executable, [sys.executable, "-m", "mlx_eagle.chat", *args], env)
        self.seen = ""  # printed since the last match
        self.transcript = ""  # all of it, for failure messages

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def enter(self, line: str) -> None:
        """Wait for the prompt, then type a line, as a person would: text typed ahead of the
        prompt races readline taking over the terminal, which may discard it."""
        self.expect(r">>> ")
        self.type(line + "\r")

    def expect(self, pattern: str, timeout: float = 240) -> re.Match:
        """Wait for ``pattern`` in what the app printed since the last match."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.seen)
            if match:
                self.seen = self.seen[match.end():]
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {pattern!r} after the last match; the session so far: "
                                     f"{self.transcript[-2000:]!r}")
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the app has exited
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"the app ended before {pattern!r}: {self.transcript[-2000:]!r}")
                text = chunk.decode(errors="replace").replace("\r\n", "\n")
                self.seen += text
                self.transcript += text

    def exit_code(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            try:
                os.read(self.fd, 4096)  # keep the pty drained
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the app did not exit")


def test_chat_in_a_terminal(random_head, tmp_path):
    app = Terminal("--draft", str(random_head), "--max-tokens", "300")
    app.expect(r"Ctrl-D to leave")
    app.enter("Name three primary colors.")
    app.expect(r"[Rr]ed")  # the answer streams in
    first = app.expect(r"(\d+) tokens, [\d.]+ tokens/s, tau [\d.]+, prompt (\d+) read \+ (\d+) cached")
    assert int(first.group(1)) > 0

    app.enter("Which of them is the color of the sky?")
    second = app.expect(r"tokens/s, tau [\d.]+, prompt (\d+) read \+ (\d+) cached")
    assert int(second.group(2)) > int(first.group(2)), "the follow-up's prompt holds the first turn (cached)"
    app.enter(f"/save {tmp_path / 'two.json'}")
    app.expect(r"saved")
    saved = json.loads((tmp_path / "two.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == [
        "Name three primary colors.", "Which of them is the color of the sky?"]
    assert len(saved["messages"]) == 4 and "red" in saved["messages"][1]["content"].lower()

    app.enter("Write a very long story about a dragon who learns to bake bread.")
    app.expect(r"story about a dragon[^\n]*\n\s*[^\s>]")  # the reply has begun
    app.type("\x03")
    app.expect(r"\(stopped\)")
    app.enter(f"/save {tmp_path / 'three.json'}")
    app.expect(r"saved")
    messages = json.loads((tmp_path / "three.json").read_text())["messages"]
    assert len(messages) == 6 and messages[4]["content"].startswith("Write a very long story")

    app.enter("/reset")
    app.expect(r"forgotten")
    app.enter(f"/save {tmp_path / 'none.json'}")
    app.expect(r"saved")
    assert json.loads((tmp_path / "none.json").read_text())["messages"] == []
    app.enter("/temp hot")
    app.expect(r"usage: /temp")
    app.enter("/quit")
    assert app.exit_code() == 0


def test_ctrl_d_leaves_cleanly():
    app = Terminal("--draft", "none")
    app.expect(r">>> ")
    app.type("\x04")
    assert app.exit_code() == 0


def test_bad_input_at_the_prompt_gets_one_line_and_the_conversation_goes_on(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    app = Terminal("--draft", "none", "--max-tokens", "8")
    app.expect(r"Ctrl-D to leave")
    for command, answer in [(f"/tree static:{tmp_path}", r"error: .*not a regular file"),
                            (f"/tree static:{tmp_path / 'list.json'}", r"error: .*rank paths"),
                            ("/temp nan", r"usage: /temp")]:
        app.enter(command)
        app.expect(answer)
    app.expect(r">>> ")
    os.write(app.fd, b"caf\xe9 \xff\xfe\r")  # Latin-1 bytes, not UTF-8
    app.expect(r"error: .*(UTF-8|Unicode)")
    app.enter("Name a color.")
    app.expect(r"\d+ tokens?, .*tau")  # still answering
    app.enter("/quit")
    assert app.exit_code() == 0
