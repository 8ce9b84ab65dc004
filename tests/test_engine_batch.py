"""One Engine serving concurrent callers in one batch (scheduler.py), on the real SmolLM2
with its shipped head and context drafts, as the server runs it: callers arrive at random
times, draft with trees of their own, ask for replies of random lengths, share
beginnings, go on with their conversations, leave while queued, while their prompt is
read or mid-reply, and fail in the middle of a round; every reply that completes is plain mlx-lm decoding's of the same
request alone, token for token. A full queue refuses with Busy."""

import random
import threading
import time
from contextlib import contextmanager

import pytest

import mlx_eagle.costs
import mlx_eagle.decoder
from mlx_eagle.costs import verify_costs
from mlx_eagle.errors import Busy
from mlx_eagle.plan import load_draft
from mlx_eagle.replies import chat_tokens
from mlx_eagle.engine import Engine
from plain import plain

pytestmark = pytest.mark.slow  # the real model

SYSTEM = "You are a careful assistant. Answer in one short sentence, plainly, and never use lists."
QUESTIONS = ["What is the capital of France?", "Name a red fruit.", "What colour is the sky?",
             "How many legs has a cat?", "What is two plus two?", "Write one line about the sea.",
             "Tell me one fact about owls.", "Why is the sea salty?"]
FAILING = "Please fail in your second round."


class Injected(Exception):
    """A failure injected into one conversation's round."""


TREES = [None, "chain:2", "static:default", "none"]  # the engine's tree, two others, context drafts alone


@contextmanager
def seated_together(engine, count):
    """The requests the block makes are seated in one turn, whatever the machine's load: the
    worker waits (on a job of its own) until ``count`` are queued."""
    gate = threading.Event()
    engine._jobs.put(lambda: gate.wait(300))
    try:
        yield
        deadline = time.monotonic() + 300
        while engine.scheduler.queued < count and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gate.set()


def caller(engine, ids, max_tokens, action, rng, results, index):
    """One client, drafting with a tree of its own: its reply's tokens, and whether it
    finished, in ``results[index]``."""
    time.sleep(rng.random() * 0.5)
    tokens, finished = [], False
    cancel = threading.Event()
    try:
        if action == "leave_queued":
            cancel.set()
        reply = engine.generate(ids, cancel=cancel, max_tokens=max_tokens, tree=rng.choice(TREES))
        for response in reply:
            tokens.append(response.token)
            finished = response.finish_reason is not None
            if action == "leave_early" and len(tokens) == 3:
                break
    except Injected:
        pass
    results[index] = (ids, max_tokens, tokens, finished, action)


@pytest.mark.parametrize("seed", [0, 1])
def test_concurrent_callers_each_get_their_reply_alone(smollm, seed, monkeypatch):
    model, tokenizer = smollm
    rng = random.Random(seed)
    accept_round = mlx_eagle.decoder.SpeculativeDecoder.accept_round
    rounds = {}

    def failing_accept(self, drafted, *args):
        # The conversation whose prompt ends with FAILING fails in its second round, in the
        # middle of a batched round; the others' rounds in that very pass go on.
        if FAILING in tokenizer.decode(drafted.committed):
            rounds[id(self)] = rounds.get(id(self), 0) + 1
            if rounds[id(self)] == 2:
                raise Injected("a round failed")
        return accept_round(self, drafted, *args)

    monkeypatch.setattr(mlx_eagle.decoder.SpeculativeDecoder, "accept_round", failing_accept)
    engine = Engine(loaded=(model, tokenizer, load_draft("auto", model)), history=False, max_concurrency=4,
                    prompt_cache_bytes=24 << 20)
    try:
        conversations = [chat_tokens(tokenizer, [{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": q}]) for q in QUESTIONS]
        checked = 0
        for wave in range(2):
            jobs = []
            for _ in range(8):
                which = rng.randrange(len(conversations))
                action = rng.choice(["complete", "complete", "complete", "leave_early", "leave_queued"])
                jobs.append((conversations[which], rng.randrange(4, 24), action))
            jobs.append((chat_tokens(tokenizer, [{"role": "user", "content": FAILING}]), 30, "complete"))
            results = [None] * len(jobs)
            threads = [threading.Thread(target=caller, args=(engine, ids, n, action, random.Random(seed * 100 + i),
                                                             results, i))
                       for i, (ids, n, action) in enumerate(jobs)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(300)
            assert all(result is not None for result in results), "a caller never returned"
            for ids, max_tokens, tokens, finished, action in results:
                if action == "leave_queued":
                    assert tokens == []
                if not finished:
                    continue
                assert tokens == plain(model, ids, max_tokens, tokenizer.eos_token_ids).tokens, (seed, wave, action)
                checked += 1
            assert not results[-1][3], "the failing conversation finished"
            # some conversations go on: their reply and a new question
            conversations += [ids + tokens + tokenizer.encode(rng.choice(QUESTIONS))
                              for ids, _, tokens, finished, _ in results[:3] if finished]
        assert checked >= 6
        assert engine.scheduler.stats["rows"] > engine.scheduler.stats["rounds"]  # rounds were shared
    finally:
        engine.close()


def test_a_full_queue_refuses_with_busy_and_a_queued_caller_can_leave(smollm):
    model, tokenizer = smollm
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup", history=False, max_concurrency=1, max_queue=1)
    try:
        ids = chat_tokens(tokenizer, [{"role": "user", "content": "Write a very long story about a dragon."}])
        first = engine.generate(ids, max_tokens=400)
        next(first)  # seated and replying
        queued = engine.generate(ids, max_tokens=4)  # waits for the seat
        with pytest.raises(Busy) as refused:
            engine.generate(ids, max_tokens=4)
        assert refused.value.retry_after >= 1 and "--max-queue 1" in str(refused.value)
        queued.close()  # leaves while queued: never runs, and frees its place
        first.close()
        deadline = time.monotonic() + 60
        while engine.in_progress:  # (the worker drops them between rounds)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        again = "".join(r.text for r in engine.generate(ids, max_tokens=6))
        assert again and engine.in_progress == 0
    finally:
        engine.close()


def test_a_hybrid_s_concurrent_callers_take_their_rounds_in_turn(tmp_path):
    """Recurrent layers do not pack: concurrent callers of a hybrid's Engine each take a
    round a turn, and each reply is still plain decoding's."""
    from hybrids import write_directory
    from mlx_eagle import load

    model, tokenizer = load(str(write_directory(tmp_path, "qwen3_next")))
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup", history=False)
    try:
        assert not engine.batches
        prompts = [tokenizer.encode(text) for text in ("one two three one two three one", "the cat sat on the",
                                                        "a b a b a b a b")]
        results = [None] * len(prompts)

        def ask(index):
            results[index] = [r.token for r in engine.generate(prompts[index], max_tokens=12)]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for prompt, tokens in zip(prompts, results):
            assert tokens == plain(model, prompt, 12, tokenizer.eos_token_ids).tokens
        assert engine.scheduler.stats["rounds"] == 0  # no pass was shared
    finally:
        engine.close()


def test_concurrent_chats_on_qwen_are_each_the_reply_alone(qwen_coder):
    """Qwen2.5-Coder-0.5B, drafting as by default (context drafts and earlier replies):
    three chats at once, one of them with tools, each reply plain decoding's."""
    model, tokenizer = qwen_coder
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    conversations = [([{"role": "user", "content": text}], tools) for text, tools in (
        ("Write a Python function that reverses a string.", None), ("What is the weather in Paris?", [weather]),
        ("def add(a, b):\n    return a + b\n\nAdd type hints to this function.", None))]
    try:
        results = [None] * len(conversations)

        def ask(index):
            messages, tools = conversations[index]
            results[index] = [r.token for r in engine.generate(chat_tokens(tokenizer, messages, tools),
                                                               max_tokens=16)]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(conversations))]
        with seated_together(engine, len(threads)):
            for thread in threads:
                thread.start()
        for thread in threads:
            thread.join(300)
        for (messages, tools), tokens in zip(conversations, results):
            assert tokens == plain(model, chat_tokens(tokenizer, messages, tools), 16, tokenizer.eos_token_ids).tokens
        assert engine.scheduler.stats["rows"] > engine.scheduler.stats["rounds"]
    finally:
        engine.close()


def test_a_seed_reproduces_its_reply_whatever_drafts_it(smollm):
    """A sampled reply with a seed is one text: alone, again (its own reply now in the earlier
    replies the context drafter reads), after unrelated requests, as one of 8 in a batch,
    and decoded plainly (--draft none), since every position samples with noise fixed by
    (seed, position) and a draft is accepted only where it equals that sample."""
    model, tokenizer = smollm
    ask = chat_tokens(tokenizer, [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Write two lines about a cat."}])
    options = {"max_tokens": 40, "temp": 0.7, "top_p": 0.95, "seed": 1234}

    def reply(engine, ids, **extra):
        return [response.token for response in engine.generate(ids, **{**options, **extra})]

    plain_engine = Engine(loaded=(model, tokenizer, None), draft="none", history=False)
    engine = Engine(loaded=(model, tokenizer, load_draft("auto", model)), history=True, max_concurrency=8)
    try:
        expected = reply(plain_engine, ask)
        assert reply(plain_engine, ask, seed=1235) != expected  # (another seed, another text: the test bites)
        assert reply(engine, ask) == expected
        assert reply(engine, ask) == expected  # its own reply is among the earlier ones now
        for question in QUESTIONS[:3]:
            reply(engine, chat_tokens(tokenizer, [{"role": "user", "content": question}]), seed=7)
        assert reply(engine, ask) == expected
        results = [None] * 8

        def call(index):
            ids = ask if index == 5 else chat_tokens(tokenizer, [{"role": "user", "content": QUESTIONS[index]}])
            results[index] = reply(engine, ids, seed=1234 if index == 5 else index)

        threads = [threading.Thread(target=call, args=(index,)) for index in range(8)]
        with seated_together(engine, len(threads)):
            for thread in threads:
                thread.start()
        for thread in threads:
            thread.join()
        assert results[5] == expected
        assert engine.scheduler.stats["rows"] > engine.scheduler.stats["rounds"]  # the batch shared passes
    finally:
        engine.close()
        plain_engine.close()


def test_a_short_request_does_not_wait_behind_another_s_long_prompt(smollm, monkeypatch):
    """A long prompt is being read when a short request arrives: the short one is read next
    (least left to read first) and answers before the long prompt's reading ends, the long
    one read meanwhile in passes bounded by time (here a bound no pass meets: the smallest,
    32 tokens here), and inside the short reply's passes once it decodes; both replies are
    plain decoding's."""
    from mlx_eagle import scheduler

    monkeypatch.setattr(scheduler, "PASS_SECONDS", 1e-6)
    monkeypatch.setattr(scheduler, "ALONE_PASS_SECONDS", 1e-6)
    monkeypatch.setattr(scheduler, "MIN_CHUNK", 32)
    model, tokenizer = smollm
    long_ids = tokenizer.encode(" ".join(QUESTIONS * 32))
    short_ids = chat_tokens(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    assert len(long_ids) > 3 * 512
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup", history=False)
    first_token, tokens, started = {}, {}, threading.Event()

    def call(name, ids, max_tokens, **extra):
        tokens[name] = []
        for response in engine.generate(ids, max_tokens=max_tokens, **extra):
            first_token.setdefault(name, time.monotonic())
            tokens[name].append(response.token)

    try:
        read = []

        def progress(done, total):
            read.append(done)
            if done:  # a chunk read: its pace is known
                started.set()

        long_caller = threading.Thread(target=call, args=("long", long_ids, 6), kwargs={"on_prompt_read": progress})
        long_caller.start()
        assert started.wait(120)
        call("short", short_ids, 24)  # (rounds enough for the long prompt's passes between)
        long_caller.join()
        assert first_token["short"] < first_token["long"]
        assert scheduler.MIN_CHUNK in {b - a for a, b in zip(read, read[1:])}, read  # bounded passes
        assert engine.scheduler.stats["chunks"] > 0  # read inside the short reply's passes
        assert tokens["short"] == plain(model, short_ids, 24, tokenizer.eos_token_ids).tokens
        assert tokens["long"] == plain(model, long_ids, 6, tokenizer.eos_token_ids).tokens
    finally:
        engine.close()


def test_agents_starting_together_on_one_long_prefix_read_it_once(smollm):
    """Two requests sharing a 1,000-token beginning arrive together: the second waits for the
    first's reading and starts from a copy of it (reading only its own end), and both replies
    are plain decoding's."""
    model, tokenizer = smollm
    prefix = tokenizer.encode(" ".join(QUESTIONS * 21))
    assert len(prefix) > 2 * 512
    asks = [prefix + tokenizer.encode(f" Question {n}: {QUESTIONS[n]}") for n in (1, 2)]
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup", history=False)
    results = [None, None]

    def call(index):
        results[index] = list(engine.generate(asks[index], max_tokens=6))

    try:
        threads = [threading.Thread(target=call, args=(index,)) for index in (0, 1)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join()
        reused = sorted(responses[-1].prompt_reused for responses in results)
        assert reused[0] == 0 and reused[1] >= len(prefix) - 16  # the beginning read once
        for ids, responses in zip(asks, results):
            assert [r.token for r in responses] == plain(model, ids, 6, tokenizer.eos_token_ids).tokens
    finally:
        engine.close()


@pytest.mark.parametrize("concurrency, draft, timed", [(4, "lookup", True), (1, "lookup", False), (4, "none", False)])
def test_an_engine_that_batches_drafts_times_packed_passes_before_serving(smollm, concurrency, draft, timed, tmp_path,
                                                                          monkeypatch):
    """time_batches (the server's, before it serves) times the packed passes that price a
    round of several conversations, so that the first such round keeps no client waiting;
    an engine that never verifies drafted rounds together times none."""
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    monkeypatch.setattr(mlx_eagle.costs, "logit_drift", lambda *_, **__: 0.0)  # (real forwards, beside the point)
    model, tokenizer = smollm
    engine = Engine(loaded=(model, tokenizer, None), draft=draft, history=False, max_concurrency=concurrency)
    try:
        engine.time_batches()
        assert (verify_costs(model).packed_ms is not None) == timed
    finally:
        engine.close()
