"""Your own drafter is first-class: named as package.module:Name or an installed entry
point in generate, chat, the server and bench, checked before the model loads; handed to
the API as an object or class; fresh for every conversation; counted on its own."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import mlx_eagle.plan
from mlx_eagle import stream_generate
from mlx_eagle.errors import UserError
from mlx_eagle.replies import chat_tokens
from mlx_eagle.generate.__main__ import main as generate_main
from mlx_eagle.plan import user_drafter
from mlx_eagle.engine import Engine
from mlx_eagle.session import ChatSession
from table_drafter import TableDrafter

TESTS = Path(__file__).resolve().parent
COPYING = "Repeat this list exactly, twice: apples, pears, plums, cherries, lemons."


def run_generate(*argv) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        generate_main(["--prompt", COPYING, "--max-tokens", "48", *argv])
    return printed.getvalue()


@pytest.mark.slow
def test_generate_takes_a_module_and_name(smollm, capsys):
    mine = run_generate("--draft", "table_drafter:TableDrafter", "--no-lookup", "--verbose")
    assert "drafts: table_drafter:TableDrafter\n" in capsys.readouterr().err  # alone, not plain decoding
    assert mine == run_generate("--draft", "none")


@pytest.mark.parametrize("spec, problem", [
    ("no_such_module_here:Drafter", "cannot import no_such_module_here"),
    ("table_drafter:Missing", "table_drafter has no Missing"),
    ("table_drafter:NOT_A_DRAFTER", "NOT_A_DRAFTER is a int, not an mlx_eagle.Drafter"),
    ("table_drafter:Counter", "Counter is a class, not an mlx_eagle.Drafter"),
])
def test_a_bad_drafter_is_one_line_before_the_model_loads(spec, problem, monkeypatch):
    monkeypatch.setattr(mlx_eagle.plan, "load", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UserError, match=problem):
        generate_main(["--draft", spec])


def test_an_installed_entry_point_names_a_drafter(tmp_path, monkeypatch):
    dist = tmp_path / "my_drafters-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-drafters\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[mlx_eagle.drafters]\ntable = table_drafter:TableDrafter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = user_drafter("table")
    assert found is not None and found.made is TableDrafter
    assert user_drafter("no-such-entry-point") is None  # left for the other readings of --draft


def test_a_function_needing_more_than_model_and_tokenizer_is_refused():
    with pytest.raises(UserError, match="needs phrases"):
        user_drafter("table_drafter:needs_phrases").factory(None, None)


def test_a_fork_copies_the_conversation_state_and_shares_a_model():
    import mlx.nn as nn

    from mlx_eagle import Drafter

    class WithModel(Drafter):
        def __init__(self):
            self.model, self.seen = nn.Linear(4, 4), [1, 2]

        def propose(self, budget):
            return None

        def observe(self, outcome):
            self.seen.append(outcome)

    template = WithModel()
    fresh = template.fork()
    assert fresh.model is template.model  # an MLX module is a dict: it was copied whole for every conversation
    assert fresh.seen == template.seen and fresh.seen is not template.seen


def test_api_objects_and_classes_draft_fresh_per_conversation(smollm):
    model, tokenizer = smollm
    ids = chat_tokens(tokenizer, [{"role": "user", "content": COPYING}])
    plain = [r.token for r in stream_generate(model, tokenizer, ids, draft="none", max_tokens=32)]
    template = TableDrafter()
    for draft in (template, TableDrafter, "table_drafter:TableDrafter"):
        responses = list(stream_generate(model, tokenizer, ids, draft=draft, lookup=False, max_tokens=32))
        assert [r.token for r in responses] == plain
        stats = responses[-1].sources
        (only,) = stats.values()
        assert 0 < only.accepted <= only.proposed
    assert not template.tokens and not template.follows  # the object handed over is a template: forked, untouched

    engine = Engine(loaded=(model, tokenizer, template), lookup=False)
    try:
        first, second = ChatSession(engine=engine, max_tokens=24), ChatSession(engine=engine, max_tokens=24)
        for session, text in ((first, COPYING), (second, "Count from one to ten."), (first, "Once more.")):
            reply = "".join(chunk.text for chunk in session.send(text))
            ids = chat_tokens(tokenizer, session.messages()[:-1])
            assert reply == "".join(r.text for r in stream_generate(model, tokenizer, ids, draft="none",
                                                                     max_tokens=24))
        drafter = engine.caches.slots[-1].drafter.drafters[0].current  # the first conversation's, used last
        assert drafter.conversations == 1, "every conversation met a drafter of its own"
        assert engine.drafting == "TableDrafter"
    finally:
        engine.close()


@pytest.mark.slow
def test_the_server_takes_your_drafter(smollm):
    root = TESTS.parent
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_eagle.server", "--port", "0", "--quiet", "--draft", "table_drafter:TableDrafter",
         "--no-lookup"], cwd=root, env=dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{TESTS}"),
        stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for line in process.stderr:
            if "at http://" in line:
                address = line.split("at http://", 1)[1].split("/v1")[0]
                break
        assert address, "the server did not start"
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="local", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": COPYING}]
        reply = client.chat.completions.create(model="default", messages=messages, max_tokens=48)
        model, tokenizer = smollm
        plain = "".join(r.text for r in stream_generate(model, tokenizer, chat_tokens(tokenizer, messages),
                                                        draft="none", max_tokens=48))
        assert reply.choices[0].message.content == plain
        drafters = reply.usage.model_extra["speculation"]["drafters"]
        assert drafters["table_drafter:TableDrafter"]["accepted"] > 0
    finally:
        process.terminate()
        process.communicate(timeout=30)
