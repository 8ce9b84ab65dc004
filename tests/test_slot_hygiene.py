"""Cache-slot hygiene, as a property: clients arrive in a random order on one Engine (as
the server's requests do), share beginnings, continue their conversations, leave while
their prompt is read, fail in the middle of a round, leave between rounds, and have
their slots evicted; every reply that completes is the same request's reply from plain
mlx-lm with no prompt cache (with the same KV-cache settings). On the real SmolLM2,
with and without quantized KV caches, and on a tiny hybrid (recurrent state)."""

import random

import pytest

import mlx_eagle.decoder
from mlx_eagle.plan import load_draft
from mlx_eagle.engine import Engine
from plain import plain

SYSTEM = ("You are a careful assistant. Answer in one short sentence, plainly, and never use lists. "
          "Say only what the question asks.")
QUESTIONS = ["What is the capital of France?", "Name a red fruit.", "What colour is the sky?",
             "How many legs has a cat?", "What is two plus two?"]
LONE = ["Write one line about the sea, the wind and the long grey harbour wall.",
        "Tell me one fact about owls and why they hunt at night in the woods."]


class Injected(Exception):
    """A failure injected into a prompt read or a round."""


def clients(engine, model, tokenizer, kv, seed, steps, monkeypatch):
    """Random clients on ``engine``; returns how many replies completed and were checked."""
    rng = random.Random(seed)
    fail_next_round = []
    verify = mlx_eagle.decoder.SpeculativeDecoder._verify

    def failing_verify(self, *args, **kwargs):
        if fail_next_round:
            fail_next_round.clear()
            raise Injected("a round failed")
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(mlx_eagle.decoder.SpeculativeDecoder, "_verify", failing_verify)
    system = tokenizer.encode(SYSTEM)
    # Clients sharing a beginning, and clients sharing nothing with anyone (whose slot is whichever is oldest).
    conversations = [system + tokenizer.encode(question) for question in QUESTIONS] + \
        [tokenizer.encode(text) for text in LONE]
    references, checked = {}, 0
    # First the tour's case (a client leaves while the first prompt is read; the next is another
    # client's), then clients at random.
    lone = len(QUESTIONS)
    script = [(lone, "leave_while_read"), (lone + 1, "complete"), (lone, "fail_in_round"), (lone + 1, "complete")]
    for step in range(steps):
        which, action = script[step] if step < len(script) else (
            rng.randrange(len(conversations)),
            rng.choice(["complete", "complete", "leave_while_read", "fail_in_round", "leave_early"]))
        ids = conversations[which]

        def reading(read, total, action=action):
            if action == "leave_while_read" and read > 0:  # (after a chunk: the first call says what is to read)
                raise Injected("the client left while its prompt was read")

        fail_next_round[:] = [True] if action == "fail_in_round" else []
        tokens, finished, first = [], False, None
        try:
            for response in engine.generate(ids, max_tokens=10, on_prompt_read=reading, logprobs=True):
                tokens.append(response.token)
                first = float(response.logprobs[tokens[0]]) if first is None else first
                finished = response.finish_reason is not None
                if action == "leave_early" and len(tokens) == 3:
                    break
        except Injected:
            continue
        if not finished:
            continue
        key = tuple(ids)
        if key not in references:
            references[key] = plain(model, ids, 10, tokenizer.eos_token_ids, kv)
        expected, expected_first = references[key]
        assert tokens == expected, (seed, action, len(ids))
        assert abs(first - expected_first) < 1e-3, (seed, action, first, expected_first)
        checked += 1
        if rng.random() < 0.5:  # the conversation goes on: its reply and a new message
            conversations[which] = ids + tokens + tokenizer.encode(rng.choice(QUESTIONS))
    return checked


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 16}],
                         ids=["float", "kv4"])
def test_every_completed_reply_is_the_request_alone_whatever_came_before(smollm, kv, monkeypatch):
    model, tokenizer = smollm
    # The shipped head and lookup, as by default; a bound of about two slots, so that slots are evicted too.
    engine = Engine(loaded=(model, tokenizer, load_draft("auto", model)), history=False, prompt_cache_bytes=12 << 20,
                    **kv)
    try:
        assert clients(engine, model, tokenizer, kv, seed=len(kv), steps=16, monkeypatch=monkeypatch) >= 4
    finally:
        engine.close()


def test_a_hybrid_s_slots_are_never_read_half_done(tmp_path, monkeypatch):
    """The cancelled read that left a recurrent state behind (its slot then reused as if
    empty) is what this catches on a hybrid."""
    from mlx_eagle import load
    from hybrids import write_directory

    model, tokenizer = load(str(write_directory(tmp_path, "qwen3_next")))
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup", history=False)
    try:
        assert clients(engine, model, tokenizer, {}, seed=7, steps=16, monkeypatch=monkeypatch) >= 4
    finally:
        engine.close()


def test_a_slot_whose_read_was_cut_is_never_taken_as_it_stands(smollm):
    """The defect itself, directly: after a read cut short, the next prompt gets fresh caches."""
    from mlx_eagle.prompt_cache import PromptCaches

    model, tokenizer = smollm
    caches = PromptCaches(model, 1 << 30)
    slot = caches.take([1, 2, 3])
    slot.unfinished = True  # as a read or round cut short leaves it
    assert caches.take([7, 8, 9]) is not slot and slot not in caches.slots


def test_a_conversation_sharing_a_beginning_with_a_quantized_slot_reads_it_in_float(smollm):
    """The tour's third defect: with --kv-bits, B after A (sharing a system prompt shorter than
    where plain decoding's cache turns quantized) must be B alone, log-probabilities too."""
    model, tokenizer = smollm
    kv = {"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 16}
    system = tokenizer.encode(SYSTEM)
    first, second = (system + tokenizer.encode(question) for question in QUESTIONS[:2])
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup", history=False, **kv)
    try:
        list(engine.generate(first, max_tokens=24))  # A's cache turns quantized while it is read
        responses = list(engine.generate(second, max_tokens=10, logprobs=True))
        tokens, logprob = plain(model, second, 10, tokenizer.eos_token_ids, kv)
        assert [r.token for r in responses] == tokens
        assert abs(float(responses[0].logprobs[tokens[0]]) - logprob) < 1e-3
    finally:
        engine.close()


def test_plans_kept_per_requested_model_id_are_bounded(smollm):
    """Every distinct request ``model`` string made a plan and a history for the server's
    life; now the least recently used go first past MAX_PLANS."""
    from mlx_eagle.drafters import history
    from mlx_eagle.engine import MAX_PLANS

    model, tokenizer = smollm
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup")
    try:
        engine._call(lambda: [engine.plan(None, f"client-{n}") for n in range(MAX_PLANS + 4)])
        assert len(engine._plans) == MAX_PLANS
        kept = {key for (_, key) in history._HISTORIES if key.startswith("client-")}
        assert kept == {f"client-{n}" for n in range(4, MAX_PLANS + 4)}
    finally:
        engine.close()


@pytest.mark.parametrize("draft", ["auto", "lookup"])
def test_a_retry_after_a_cancelled_read_reads_only_what_the_first_did_not(smollm, draft):
    """A client that leaves while its long prompt is read leaves the finished chunks in the
    cache as a clean prefix: its retry reads on from there (the head, which reads the target's
    states, having observed them too), and its reply is plain decoding's."""
    model, tokenizer = smollm
    ids = tokenizer.encode(" ".join(LONE * 40) + " Now say which line came first.")
    assert len(ids) > 1200
    engine = Engine(loaded=(model, tokenizer, load_draft(draft, model)), draft=draft, history=False)
    try:
        def leave(read, total):
            if read >= 512:
                raise Injected("the client gave up waiting")

        with pytest.raises(Injected):
            list(engine.generate(ids, max_tokens=8, on_prompt_read=leave))
        responses = list(engine.generate(ids, max_tokens=8))
        assert responses[-1].prompt_reused >= 512
        assert [r.token for r in responses] == plain(model, ids, 8, tokenizer.eos_token_ids).tokens
    finally:
        engine.close()
