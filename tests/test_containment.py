"""A plug-in drafter is contained: whatever it raises (making it, propose, observe, fork,
branch) or however long its propose takes, one warning names it and the error, and the
conversation goes on without it with the model's own text; a module that fails at import
is one line. And the server's SIGTERM ends it within its promised 10 s even while a
drafter is stuck, while /health says a generation has made no progress."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from mlx_eagle import Proposal, stream_generate
from mlx_eagle.errors import UserError
from mlx_eagle.replies import chat_tokens
from mlx_eagle.plan import UserDrafter, user_drafter
from table_drafter import TableDrafter

TESTS = Path(__file__).resolve().parent
PROMPT = [{"role": "user", "content": "Repeat this list exactly, twice: apples, pears, plums, cherries."}]


class RaisesIn(TableDrafter):
    """The table drafter, raising in ``where`` after a few calls."""

    where = "propose"

    def __init__(self):
        super().__init__()
        self.calls = 0
        if self.where == "init":
            raise RuntimeError("broken at birth")

    def _maybe(self, name):
        self.calls += 1
        if name == self.where and self.calls > 2:
            raise ValueError(f"broken in {name}")
        if self.where == "exit" and self.calls > 2:
            sys.exit("a plug-in that exits")  # on its own thread: contained like any error

    def propose(self, budget):
        self._maybe("propose")
        return super().propose(budget)

    def observe(self, outcome):
        self._maybe("observe")
        super().observe(outcome)

    def fork(self):
        if self.where == "fork":
            raise KeyError("no fork today")
        return super().fork()


class Hangs(TableDrafter):
    """A propose that never returns."""

    time_limit = 0.5

    def propose(self, budget):
        if len(self.tokens) > 40:
            threading.Event().wait()
        return super().propose(budget)


@pytest.mark.parametrize("where", ["propose", "observe", "init", "fork", "exit"])
def test_a_drafter_that_raises_warns_once_and_the_text_is_the_model_s(smollm, where, capsys):
    model, tokenizer = smollm
    ids = chat_tokens(tokenizer, PROMPT)
    plain = [r.token for r in stream_generate(model, tokenizer, ids, draft="none", max_tokens=24)]
    kind = type(f"Raises_{where}", (RaisesIn,), {"where": where})
    draft = kind() if where == "fork" else kind
    responses = list(stream_generate(model, tokenizer, ids, draft=draft, max_tokens=24))
    assert [r.token for r in responses] == plain
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: drafter")]
    assert len(warnings) == 1 and kind.__name__ in warnings[0] and "went on without it" in warnings[0], warnings
    (off,) = responses[-1].drafting_off  # the reply says so too (the server's usage.speculation.drafting_off)
    assert "failed" in off


def test_a_propose_that_never_returns_is_abandoned_after_its_time_limit(smollm, capsys):
    model, tokenizer = smollm
    ids = chat_tokens(tokenizer, PROMPT)
    plain = [r.token for r in stream_generate(model, tokenizer, ids, draft="none", max_tokens=24)]
    tic = time.monotonic()
    got = [r.token for r in stream_generate(model, tokenizer, ids, draft=Hangs, max_tokens=24)]
    assert got == plain and time.monotonic() - tic < 30
    assert "took longer than its time_limit (0.5 s)" in capsys.readouterr().err


class StuckInObserve(TableDrafter):
    """An observe that never returns, in the conversation whose prompt is ``stuck_length`` long."""

    stuck_length = 0

    def observe(self, outcome):
        if outcome.from_prompt:
            self.prompt_length = len(outcome.tokens) - 1
        if getattr(self, "prompt_length", 0) == self.stuck_length and len(outcome.tokens) > self.prompt_length + 4:
            threading.Event().wait()
        super().observe(outcome)


def test_an_observe_that_never_returns_stalls_only_its_own_conversation(smollm, monkeypatch, capsys):
    """Four conversations in one batch, one drafter's observe stuck for good: the other three
    finish, each with plain decoding's text (so does the stuck one, without its drafter)."""
    from mlx_eagle import plan
    from mlx_eagle.engine import Engine

    batch = 4
    monkeypatch.setattr(plan, "CALL_LIMIT", 2.0)
    model, tokenizer = smollm
    questions = ["Say hi.", "Name three colours, one per line.",
                 "List the days of the week, one per line, starting with Monday, and nothing else."]
    prompts = [chat_tokens(tokenizer, PROMPT)] + [chat_tokens(tokenizer, [{"role": "user", "content": question}])
                                                  for question in questions[:batch - 1]]
    monkeypatch.setattr(StuckInObserve, "stuck_length", len(prompts[0]))
    assert len({len(ids) for ids in prompts}) == batch
    plain = [[r.token for r in stream_generate(model, tokenizer, ids, draft="none", max_tokens=24)] for ids in prompts]
    engine = Engine(loaded=(model, tokenizer, UserDrafter(StuckInObserve, "stuck")), history=False,
                    max_concurrency=batch)
    results = [None] * batch

    def call(index):
        results[index] = [r.token for r in engine.generate(prompts[index], max_tokens=24)]

    try:
        tic = time.monotonic()
        threads = [threading.Thread(target=call, args=(index,), daemon=True) for index in range(batch)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert results == plain and time.monotonic() - tic < 60
    finally:
        engine.close()
    assert "observe took longer than the bound on a drafter's calls (2 s)" in capsys.readouterr().err


def test_a_module_that_fails_at_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "fails_at_import.py").write_text("raise RuntimeError('the GPU is on fire')\n")
    (tmp_path / "bad_syntax.py").write_text("def broken(:\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, says in [("fails_at_import:Mine", "RuntimeError: the GPU is on fire"),
                       ("bad_syntax:Mine", "SyntaxError"), ("exits_at_import:Mine", "SystemExit")]:
        with pytest.raises(UserError, match=says) as raised:
            user_drafter(spec)
        assert "\n" not in str(raised.value)


def test_a_chain_of_impossible_ids_names_the_id():
    with pytest.raises(ValueError, match="token id 1000000000000"):
        Proposal.chain([5, 10 ** 12])


class Unread(list):
    """A list that must not be read whole (only cut)."""

    def __iter__(self):
        raise AssertionError("the whole proposal was read")


def test_a_huge_proposal_is_read_only_as_far_as_admission_looks():
    """200,000 nodes are cut to the first 4,096 (what admission reads) before any is read."""
    from mlx_eagle.drafters import Budget
    from mlx_eagle.drafters.admit import admit
    from mlx_eagle.trees import DraftTree

    count = 200_000
    huge = Proposal(DraftTree(Unread([7] * count), Unread(range(-1, count - 1)), []), Unread([7] * count))
    assert len(admit(huge, Budget(room=8, nodes=16, vocab=100))) == 8


STUCK = """
import threading
from table_drafter import TableDrafter

class Stuck(TableDrafter):
    time_limit = None  # no limit: the engine waits for it for ever

    def propose(self, budget):
        if len(self.tokens) > 30:
            threading.Event().wait()
        return super().propose(budget)
"""


@pytest.mark.slow  # the real model, in a server process
def test_sigterm_ends_a_server_whose_drafter_is_stuck_and_health_says_so(tmp_path):
    (tmp_path / "stuck_drafter.py").write_text(STUCK)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{TESTS}")
    process = subprocess.Popen([sys.executable, "-m", "mlx_eagle.server", "--port", "0", "--draft",
                                "stuck_drafter:Stuck", "--no-lookup", "--stall-seconds", "2", "--quiet"],
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while "serving" not in line:
            line = process.stderr.readline()
            assert line, "the server ended before serving"
        base = line.split("at ")[-1].strip()
        body = json.dumps({"messages": PROMPT, "max_tokens": 64}).encode()
        request = urllib.request.Request(f"{base}/chat/completions", body, {"Content-Type": "application/json"})
        threading.Thread(target=lambda: _quietly(urllib.request.urlopen, request, timeout=120), daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base.rsplit('/v1', 1)[0]}/health", timeout=10)
            except urllib.error.HTTPError as error:
                assert error.code == 503 and json.loads(error.read())["status"] == "stalled"
                break
            assert time.monotonic() < deadline, "/health never said the generation stalled"
            time.sleep(0.5)
        tic = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
        assert time.monotonic() - tic <= 10  # (STOP_SECONDS, as documented)
    finally:
        process.kill()
        process.communicate()


def _quietly(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except OSError:
        pass


def test_a_drafter_s_thread_ends_with_its_conversation(smollm):
    """Each conversation's plug-in drafter runs on a thread of its own: it must end when the
    conversation's drafter goes, not pile up over a server's life."""
    import gc

    model, tokenizer = smollm
    ids = chat_tokens(tokenizer, PROMPT)
    before = set(threading.enumerate())  # (an abandoned propose's thread, stuck for good, may be among them)

    def new_runners():
        return [t for t in threading.enumerate() if t.name == "mlx-eagle-drafter" and t not in before]

    for _ in range(6):
        list(stream_generate(model, tokenizer, ids, draft=TableDrafter, max_tokens=4))
    gc.collect()
    deadline = time.monotonic() + 10
    while new_runners() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not new_runners()
