"""The chat-session API on the real SmolLM2: turns reuse the KV cache and still give
the text a fresh prefill of the whole conversation gives; cancelling from another
thread stops within one round; history round-trips as plain data; an overflowing
history loses its oldest turns with a notice."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mlx_eagle import stream_generate
from mlx_eagle.errors import UserError
from mlx_eagle.replies import chat_tokens
from mlx_eagle.heads import new_head
from mlx_eagle.engine import Engine
from mlx_eagle.session import ChatSession, TurnStats

ROOT = Path(__file__).resolve().parent.parent
TURNS = ["Name three primary colors.", "Which of them is the color of the sky?", "Write one sentence about it."]


@pytest.fixture(scope="module")
def engine(smollm):
    model, tokenizer = smollm
    head = new_head(model, "eagle3", seed=4)  # random, so some drafts fail and some caches are cut back
    engine = Engine(loaded=(model, tokenizer, head))
    yield engine
    engine.close()


def fresh_reply(engine, messages, max_tokens):
    """The reply from a new cache: the whole conversation read again."""
    ids = chat_tokens(engine.tokenizer, messages)
    return "".join(r.text for r in stream_generate(engine.model, engine.tokenizer, ids, max_tokens=max_tokens,
                                                   draft=engine.head, tree="static:default"))


def test_turns_reuse_the_cache_and_match_a_fresh_prefill(engine):
    chat = ChatSession(engine=engine, tree="static:default", max_tokens=16, system="Answer briefly.")
    reused = []
    for turn in TURNS:
        reply = "".join(chunk.text for chunk in chat.send(turn))
        assert reply == fresh_reply(engine, chat.messages()[:-1], 16), turn
        reused.append(chat.stats.prompt_reused)
    assert reused[0] == 0 and all(r > 20 for r in reused[1:])
    # A follow-up sees the earlier turns: they are in its prompt.
    assert [m["content"] for m in chat.history if m["role"] == "user"] == TURNS
    # An edited history shares only a prefix with the cache: still the fresh text.
    chat.history = chat.history[:2]
    reply = "".join(chunk.text for chunk in chat.send("And a fourth color?"))
    assert reply == fresh_reply(engine, chat.messages()[:-1], 16)


def test_cancel_from_another_thread_stops_within_one_round(engine):
    chat = ChatSession(engine=engine, tree="static:default", max_tokens=200)
    seen, done = [], threading.Event()
    at_cancel = {}

    def on_chunk(chunk):
        seen.append(chunk)
        if len(seen) == 3:
            at_cancel["forwards"] = chunk.target_forwards
            threading.Thread(target=chat.cancel).start()  # as a GUI's button would

    chat.send_in_background("Tell me a long story about a lighthouse keeper.", on_chunk,
                            lambda error: done.set()).join(timeout=300)
    assert done.is_set()
    assert len(seen) < 200 and chat.stats.finish_reason == "cancelled"
    # The round in flight may finish; no further round starts.
    assert seen[-1].target_forwards <= at_cancel["forwards"] + 1
    assert chat.history[-1]["content"] == "".join(c.text for c in seen)
    chat.options = chat.options.but(max_tokens=8)
    assert "".join(c.text for c in chat.send("Thanks!"))  # the session carries on


def test_a_session_cancels_only_its_own_reply(engine):
    """Two sessions on one engine: the second's cancel, while it waits behind the first,
    stops the second (it never runs) and leaves the first to finish."""
    first = ChatSession(engine=engine, tree="static:default", max_tokens=24)
    second = ChatSession(engine=engine, tree="static:default", max_tokens=24)
    started, results = threading.Event(), {}

    def on_first_chunk(chunk):
        started.set()

    def finished(name):
        return lambda error: results.setdefault(name, error)

    one = first.send_in_background("Count from one to twenty in words.", on_first_chunk, finished("first"))
    assert started.wait(timeout=120)
    two = second.send_in_background("Name a color.", lambda chunk: None, finished("second"))
    second.cancel()
    one.join(timeout=300)
    two.join(timeout=300)
    assert results == {"first": None, "second": None}
    assert first.stats.finish_reason in ("length", "stop")  # not cancelled
    assert second.stats is None and second.history == []  # cancelled before its first token: no turn


def test_a_cancel_right_after_sending_in_the_background_is_kept(engine):
    """The reply may have started on the worker before the cancel: it stops at the first
    token it hands out (the engine checks after each), instead of running on to 200."""
    chat = ChatSession(engine=engine, tree="static:default", max_tokens=200)
    seen = []
    thread = chat.send_in_background("Tell me a long story about a lighthouse keeper.", seen.append)
    chat.cancel()
    thread.join(timeout=300)
    assert len(seen) <= 6
    if seen:
        assert chat.stats.finish_reason == "cancelled" and chat.history[-1]["content"] == "".join(c.text for c in seen)
    else:
        assert chat.history == []


def test_history_round_trips_as_plain_data(engine):
    chat = ChatSession(engine=engine, max_tokens=8, system="Be terse.")
    list(chat.send("Hello"))
    data = json.loads(json.dumps(chat.messages()))
    again = ChatSession(engine=engine, max_tokens=8)
    again.history = data
    assert again.system == "Be terse." and again.messages() == chat.messages()
    again.reset()
    assert again.history == [] and again.system == "Be terse."
    for bad in ("hello", [{"role": "robot", "content": "hi"}], [{"role": "user", "content": 3}]):
        with pytest.raises(UserError):
            again.history = bad


def test_oldest_turns_are_dropped_when_the_context_fills(engine):
    notices = []
    limit = engine.context_length
    chat = ChatSession(engine=engine, max_tokens=8, on_notice=notices.append)
    list(chat.send("Hello"))
    list(chat.send("How are you?"))
    # A reply budget that leaves room for one turn only: the older two must go.
    prompt = chat_tokens(engine.tokenizer, chat.messages([{"role": "user", "content": "Bye"}]))
    chat.options = chat.options.but(max_tokens=limit - len(prompt) + 30)
    for _ in chat.send("Bye"):
        break  # the first piece is enough; leaving the loop cancels the rest
    assert notices and "dropped the oldest 2 turns" in notices[0]
    assert [m["content"] for m in chat.history if m["role"] == "user"] == ["Bye"]
    with pytest.raises(UserError, match="context"):
        list(chat.send("word " * limit))


@pytest.mark.slow  # real processes with the real model
@pytest.mark.parametrize("ending", ["chat.engine.close()", "pass"])
def test_a_process_that_used_a_session_exits_cleanly(ending):
    """MLX aborts at exit when a finished thread's streams are left to its C++ teardown;
    the engine clears them, whether closed or simply left for the interpreter to end."""
    script = ("from mlx_eagle.session import ChatSession\n"
              "chat = ChatSession(draft='none', max_tokens=3)\n"
              "print(''.join(chunk.text for chunk in chat.send('Hi')))\n" + ending + "\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_the_stats_line_gives_a_speed_only_from_two_tokens():
    stopped = TurnStats(tokens=1, tokens_per_s=4290.1, tau=0.0, prompt_tokens=44, prompt_reused=0,
                        prompt_seconds=0.5, finish_reason="cancelled")
    assert stopped.line() == "1 token, tau 0.00, prompt 44 read + 0 cached in 0.50 s"
    reply = TurnStats(tokens=24, tokens_per_s=10.61, tau=1.5, prompt_tokens=60, prompt_reused=40,
                      prompt_seconds=0.2, finish_reason="stop")
    assert reply.line() == "24 tokens, 10.6 tokens/s, tau 1.50, prompt 20 read + 40 cached in 0.20 s"


def test_interleaved_conversations_each_keep_their_cache_and_share_their_beginning(smollm):
    """Two conversations with one long system prompt, their turns interleaved through one
    engine drafting with a head and the context: the second reads the shared beginning
    from a copy of the first's caches, the head's own included (Drafter.branch), each later
    turn reads only its new tokens, and every reply is the one plain decoding gives. A
    bound of one byte keeps only the conversation in use."""
    model, tokenizer = smollm
    system = {"role": "system", "content": "You are a careful assistant for a hardware shop. " * 12}
    head = new_head(model, "eagle3", seed=4)  # random: some drafts fail, so the copied caches are cut back
    # (a chain: with tree auto a random head drafts nothing)
    engine = Engine(loaded=(model, tokenizer, head), history=False, tree="chain:3")
    try:
        conversations = {"a": [system], "b": [system]}
        asked = [("a", "Do you sell hammers?"), ("b", "Do you sell nails?"), ("a", "How much is one?"),
                 ("b", "And a box of them?")]
        reused = []
        for name, text in asked:
            conversation = conversations[name]
            conversation.append({"role": "user", "content": text})
            ids = chat_tokens(tokenizer, conversation)
            responses = list(engine.generate(ids, max_tokens=12))
            reply = "".join(r.text for r in responses)
            assert reply == "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=12, draft=None))
            reused.append((responses[-1].prompt_reused, len(ids)))
            conversation.append({"role": "assistant", "content": reply})
        shared = len(chat_tokens(tokenizer, [system])) - 2
        assert reused[0][0] == 0 and shared <= reused[1][0] < reused[1][1]
        assert all(count > 0.8 * total for count, total in reused[2:])
        assert len(engine.caches.slots) == 2
        engine.caches.max_bytes = 1
        list(engine.generate(chat_tokens(tokenizer, conversations["a"] + [{"role": "user", "content": "Thanks"}]),
                             max_tokens=2))
        assert len(engine.caches.slots) == 1
    finally:
        engine.close()


def test_a_request_is_cancelled_while_its_long_prompt_is_read(smollm):
    """Cancelling stops a long prompt between two of its chunks: no token comes, and the
    engine serves the next request with the text a fresh cache gives."""
    model, tokenizer = smollm
    engine = Engine(loaded=(model, tokenizer, None), history=False)
    try:
        ids = chat_tokens(tokenizer, [{"role": "user", "content": "word " * 2500 + "How many words?"}])
        cancel = threading.Event()

        def cancel_once_busy():
            while not engine.in_progress:
                threading.Event().wait(0.01)
            cancel.set()

        threading.Thread(target=cancel_once_busy, daemon=True).start()
        assert list(engine.generate(ids, cancel=cancel, max_tokens=4)) == []
        question = chat_tokens(tokenizer, [{"role": "user", "content": "Name a color."}])
        reply = "".join(r.text for r in engine.generate(question, max_tokens=8))
        assert reply == "".join(r.text for r in stream_generate(model, tokenizer, question, max_tokens=8, draft=None))
    finally:
        engine.close()
