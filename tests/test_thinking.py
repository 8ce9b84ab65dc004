"""Thinking budgets inside speculation (mlx_eagle/thinking.py). No reasoning model is among
the offline weights: the real-weights checks run Qwen2.5-Coder-0.5B-Instruct with Qwen3's
thinking markers and a chat template that opens a thinking block (conftest's
``qwen_thinking_dir``), against mlx-lm's plain decoding with the budget rule written here
again, independently, as a logits processor. The tree shaping is checked on hand-made
trees, and sampling on the six-token model against the exact distribution under the rule."""

import json
import threading

import anthropic
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import load as load_tokenizer

from drafting import decoder as make_decoder
from mlx_eagle.generation import stream_generate
from mlx_eagle.thinking import EFFORT_BUDGETS, ThinkingBudget, thinking_budget_for
from mlx_eagle.verify import Sampling
from oracle import FixedDraft
from sampling_checks import PROMPT, TREE, VOCAB, chi_square_ok

START, END = 5, 3  # the six-token model's thinking markers, for the unit checks


def budget_processor(prompt_length, end, budget, open_at_start=True):
    """The rule as plain decoding applies it: once the reply's thinking holds ``budget``
    tokens, only the end marker (one token here) may follow."""
    def process(tokens, logits):
        reply = [int(t) for t in np.array(tokens)[prompt_length:]]
        spent, thinking = 0, open_at_start
        for token in reply:
            if thinking:
                spent += 1
                thinking = token != end
        if thinking and spent >= budget:
            return mx.where(mx.arange(logits.shape[-1]) == end, logits, -mx.inf)
        return logits
    return process


def test_shape_cuts_drafts_past_the_budget_and_grafts_the_end_marker():
    budget = ThinkingBudget([START], [END], 2, PROMPT + [START], VOCAB)
    assert budget.mask_now() is None  # nothing forced yet: rounds are not masked
    assert not budget.binds(1) and budget.binds(2)  # a round one row deep cannot reach it: not shaped
    # root -> 0 -> 1 -> 2 (past the budget: cut, with its child 4); root -> 3 (the end marker itself)
    shaped = budget.shape([0, 1, 2, 4, 3], [-1, 0, 1, 2, -1], room=8, nodes=16)
    assert shaped.placed == [0, 1, None, None, 2]
    assert shaped.tree.tokens[3:] == [END] and shaped.tree.parents[3] == 1  # the marker, grafted after 0 -> 1
    assert shaped.forced_from == 3
    rows = np.array(shaped.allowed).view(np.uint32)[:, 0]
    assert rows[2] == 1 << END  # after two thinking tokens: the marker alone
    assert rows[0] & rows[1] & rows[3] & rows[4] == (1 << 32) - 1  # before the budget, and after the marker: free
    budget.commit([0, 1])
    assert np.array(budget.mask_now())[0, 0] == 1 << END
    budget.commit([END, 2])  # the thinking ended: free again, and no block reopens by itself
    assert budget.mask_now() is None
    closed = ThinkingBudget([START], [END], 0, PROMPT + [START, 1, END], VOCAB)
    assert closed.mask_now() is None  # the prompt's block is closed: nothing to budget
    closed.commit([START])  # the reply opens one: with no budget left, the marker follows at once
    assert np.array(closed.mask_now())[0, 0] == 1 << END


def test_sampling_follows_the_distribution_under_the_rule(six_token_model):
    """The first three tokens over many seeds, with a draft the budget partly cuts, against the
    exact joint distribution of plain decoding under the rule (budget 1, over the reply: after
    one thinking token the end marker is forced, unless that token was the marker; a block
    the reply opens again has no budget left)."""
    sampling = Sampling(temp=1.0)
    prompt = PROMPT + [START]

    def probs(context):
        return np.array(sampling.probabilities(six_token_model(mx.array([prompt + context]))[0, -1])).astype(
            np.float64)

    joint = np.zeros((VOCAB,) * 3)
    p1 = probs([])
    for t1 in range(VOCAB):
        p2 = np.eye(VOCAB)[END] if t1 != END else probs([t1])
        for t2 in range(VOCAB):
            p3 = np.eye(VOCAB)[END] if (t1, t2) == (END, START) else probs([t1, t2])
            joint[t1, t2] = p1[t1] * p2[t2] * p3
    counts, forced = np.zeros((VOCAB,) * 3), 0
    for seed in range(1500):
        budget = ThinkingBudget([START], [END], 1, prompt, VOCAB)
        decoder = make_decoder(six_token_model, FixedDraft([0, 4, 1, 2], VOCAB), TREE, sampling, seed=seed,
                               grammar=budget)
        tokens = [decoder.prefill(prompt)]
        while len(tokens) < 3:
            tokens += decoder.round(3 - len(tokens)).tokens
        counts[tuple(tokens[:3])] += 1
        forced += budget.forced.accepted
    assert chi_square_ok(counts, joint)
    assert forced > 500  # the marker was drafted for free, and accepted


@pytest.fixture(scope="module")
def thinking_model(qwen_coder, qwen_thinking_dir):
    """Qwen2.5-Coder-0.5B's weights with the thinking tokenizer and template."""
    model, _ = qwen_coder
    return model, load_tokenizer(qwen_thinking_dir)


QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 5, 17])
def test_greedy_text_equals_plain_decoding_under_the_same_budget(thinking_model, budget):
    model, tokenizer = thinking_model
    assert tokenizer.has_thinking and tokenizer.think_end_tokens == (151668,)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert thinking_budget_for(tokenizer, ids, budget, model.args.vocab_size) is not None  # the template opened it
    end = tokenizer.think_end_tokens[0]
    expected = []
    for (token, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=30,
                                           logits_processors=[budget_processor(len(ids), end, budget)]), range(30)):
        expected.append(int(token))
        if expected[-1] in tokenizer.eos_token_ids:
            break
    responses = list(stream_generate(model, tokenizer, ids, max_tokens=30, thinking_budget=budget))
    assert [r.token for r in responses] == expected
    assert expected.index(end) == budget  # the thinking held the budget, then the marker
    if budget:  # (a budget of 0 forces the first token, which no round drafts)
        assert responses[-1].sources["thinking budget (forced tokens)"].accepted >= 1


@pytest.mark.slow
def test_the_protocols_budget_thinking_and_answer_it_as_thinking(thinking_model, monkeypatch):
    """Messages' thinking.budget_tokens, Responses' reasoning.effort and chat completions'
    thinking_budget all end the thinking where plain decoding under the rule does; the
    thinking comes back as a thinking block, a reasoning item and reasoning_content."""
    from mlx_eagle.server import Server
    from mlx_eagle.engine import Engine

    model, tokenizer = thinking_model
    engine = Engine(loaded=(model, tokenizer, None), name="qwen-thinking", history=False)
    server = Server(("127.0.0.1", 0), engine=engine, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
        plain = list(stream_generate(model, tokenizer, ids, max_tokens=16, thinking_budget=6, draft="none"))
        thought = "".join(r.text for r in plain).split("</think>")[0]
        claude = anthropic.Anthropic(base_url=base, api_key="local", max_retries=0, timeout=300)
        reply = claude.messages.create(model="claude-x", max_tokens=16, messages=QUESTION,
                                       thinking={"type": "enabled", "budget_tokens": 6})
        assert reply.content[0].type == "thinking" and reply.content[0].thinking == thought
        oai = openai.OpenAI(base_url=base + "/v1", api_key="local", max_retries=0, timeout=300)
        chat = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=16,
                                           extra_body={"thinking_budget": 6})
        assert json.loads(chat.model_dump_json())["choices"][0]["message"]["reasoning_content"] == thought
        monkeypatch.setitem(EFFORT_BUDGETS, "minimal", 6)  # (128 by default: a shorter test)
        response = oai.responses.create(model="m", input=QUESTION[0]["content"], max_output_tokens=16,
                                        reasoning={"effort": "minimal"})
        assert response.output[0].type == "reasoning" and response.output[0].content[0].text == thought
        with claude.messages.stream(model="claude-x", max_tokens=16, messages=QUESTION,
                                    thinking={"type": "enabled", "budget_tokens": 6}) as stream:
            kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)) for event in stream]
            final = stream.get_final_message()
        assert ("content_block_delta", "thinking_delta") in kinds and final.content[0].thinking == thought
        with pytest.raises(anthropic.BadRequestError, match="thinking budget and a structured output"):
            claude.messages.create(model="claude-x", max_tokens=16, messages=QUESTION, stream=True,
                                   thinking={"type": "enabled", "budget_tokens": 6},
                                   output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
        disabled = claude.messages.create(model="claude-x", max_tokens=20, messages=QUESTION)
        assert all(block.type != "thinking" for block in disabled.content)  # the template's empty block
    finally:
        server.shutdown()
        server.server_close()
        engine.close()
