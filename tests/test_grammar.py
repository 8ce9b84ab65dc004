"""Structured outputs stay lossless: a reply held to a grammar is, token for token, what
plain decoding with the grammar's mask applied at each step produces (mlx-lm's own loop with
a logits processor, on real weights, with a head's trees and with context drafts), and
samples follow the masked distribution (chi-square). The tree shaping itself: cut nodes,
masks per row, forced tokens."""

import json
from typing import List

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from drafting import decoder as make_decoder
from mlx_eagle.errors import UserError
from mlx_eagle.generation import stream_generate
from mlx_eagle.replies import chat_tokens
from mlx_eagle.grammar import Grammar, mask_logits, response_grammar, schema_grammar
from mlx_eagle.verify import Sampling
from oracle import FixedDraft
from plain import plain_constrained, reference_matcher
from sampling_checks import PROMPT, TREE, VOCAB, chi_square_ok

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"},
    "fields": {"type": "array", "items": {"enum": ["mathematics", "computing", "poetry", "music"]}}},
    "required": ["name", "born", "fields"], "additionalProperties": False}
# A lark grammar over the six-token vocabulary ("a" .. "e", then the end of sequence).
SIX_TOKEN_GRAMMAR = 'start: ("a"|"b") ("c"|"a"|"d")* "b" "c"?'


@pytest.fixture(scope="module")
def six_token_tokenizer():
    """A byte-level tokenizer whose tokens are the letters a-e and <eos> (id 5)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE({"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "<eos>": 5}, [], unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>"))


def six_token_grammar(tokenizer) -> Grammar:
    return Grammar(tokenizer, llguidance.LLMatcher.grammar_from_lark(SIX_TOKEN_GRAMMAR), VOCAB)


def allowed_set(matcher: llguidance.LLMatcher, vocab: int) -> set:
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    return {t for t in range(vocab) if bits[t >> 5] >> (t & 31) & 1}


def test_shape_cuts_what_the_grammar_refuses_masks_every_row_and_drafts_forced_tokens(six_token_tokenizer):
    grammar = six_token_grammar(six_token_tokenizer)
    grammar.commit([0])  # the root: "a"
    # Drafted after the root: c (allowed) -> e (refused: cut, with its child a), d -> b -> c;
    # and b (allowed; its subtree c, then nothing may follow but the end).
    tokens, parents = [2, 1, 4, 0, 3, 1, 2], [-1, -1, 0, 2, 0, 4, 5]
    shaped = grammar.shape(tokens, parents, room=8, nodes=32)
    assert shaped.placed == [0, 1, None, None, 2, 3, 4]
    assert shaped.tree.tokens[:5] == [2, 1, 3, 1, 2] and shaped.tree.parents[:5] == [-1, -1, 0, 2, 3]
    # a row per node: the grammar's mask after the root and the node's path, from a matcher of its own
    reference = reference_matcher(six_token_tokenizer, llguidance.LLMatcher.grammar_from_lark(SIX_TOKEN_GRAMMAR), 6)
    reference.consume_token(0)
    rows = np.array(shaped.allowed)
    for row in range(len(shaped.tree) + 1):
        path, node = [], row - 1
        while node >= 0:
            path.insert(0, shaped.tree.tokens[node])
            node = shaped.tree.parents[node]
        assert reference.consume_tokens(path)
        got = {t for t in range(6) if rows[row, 0] >> t & 1}
        # (where the grammar has ended, the end of sequence alone: the reply never runs on)
        assert got == (allowed_set(reference, 6) if not reference.is_stopped() else {5}), path
        reference.rollback(len(path))
    masked = np.array(mask_logits(mx.zeros((len(shaped.tree) + 1, 6)), shaped.allowed))
    assert np.isneginf(masked[1, 4]) and masked[1, 0] == 0  # row 1, after "a c": "e" refused, "a" allowed
    # the matcher is where it was: its next mask is the root's row
    assert np.array_equal(np.array(grammar.mask_now())[0], rows[0])


def test_forced_tokens_are_drafted_after_the_best_path(six_token_tokenizer):
    grammar = Grammar(six_token_tokenizer, llguidance.LLMatcher.grammar_from_lark('start: "a" "b" "c" "d" ("a"|"e")*'),
                      VOCAB)
    grammar.commit([0])
    shaped = grammar.shape([], [], room=8, nodes=32)  # nothing drafted: the grammar's own "b c d"
    assert shaped.tree.tokens == [1, 2, 3] and shaped.tree.parents == [-1, 0, 1] and shaped.placed == []
    shaped = grammar.shape([1, 4], [-1, -1], room=2, nodes=32)  # "b" kept, "e" cut; then "c" within room 2
    assert shaped.tree.tokens == [1, 2] and shaped.placed == [0, None]
    assert grammar.shape([], [], room=8, nodes=0).tree.tokens == []  # no room for drafts: none forced


def test_sampling_follows_the_masked_distribution(six_token_model, six_token_tokenizer):
    """The first three tokens over many seeds, with a draft the grammar partly refuses,
    against the exact joint distribution of plain decoding with the mask at each step."""
    sampling = Sampling(temp=1.0)
    reference = reference_matcher(six_token_tokenizer, llguidance.LLMatcher.grammar_from_lark(SIX_TOKEN_GRAMMAR), 6)

    def masked(context: List[int]) -> np.ndarray:
        logits = np.array(six_token_model(mx.array([PROMPT + context]))[0, -1]).astype(np.float32)[None]
        llguidance.numpy.apply_token_bitmask_inplace(logits, np.frombuffer(reference.compute_bitmask(),
                                                                             dtype=np.int32)[None].copy())
        return np.array(sampling.probabilities(mx.array(logits[0]))).astype(np.float64)

    joint = np.zeros((VOCAB,) * 3)
    p1 = masked([])
    for t1 in np.flatnonzero(p1):
        reference.consume_token(int(t1))
        p2 = masked([int(t1)])
        for t2 in np.flatnonzero(p2):
            reference.consume_token(int(t2))
            joint[t1, t2] = p1[t1] * p2[t2] * (masked([int(t1), int(t2)]) if not reference.is_stopped()
                                               else np.array(sampling.probabilities(
                                                   six_token_model(mx.array([PROMPT + [int(t1), int(t2)]]))[0, -1])))
            reference.rollback(1)
        reference.rollback(1)
    counts, accepted = np.zeros((VOCAB,) * 3), 0
    samples = 1500
    for seed in range(samples):
        decoder = make_decoder(six_token_model, FixedDraft([0, 4, 1, 2], VOCAB), TREE, sampling, seed=seed,
                               grammar=six_token_grammar(six_token_tokenizer))
        tokens = [decoder.prefill(PROMPT)]
        while len(tokens) < 3:
            result = decoder.round(3 - len(tokens))
            tokens += result.tokens
            accepted += len(result.tokens) - 1
        counts[tuple(tokens[:3])] += 1
    assert chi_square_ok(counts, joint)
    assert accepted > samples / 4  # drafts were accepted: the masks were on tree nodes
    assert counts[:, 4].sum() == 0 and counts[4].sum() == 0  # "e" is never allowed there


def speculative(model, tokenizer, prompt: List[int], response_format, draft, max_tokens: int):
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, draft=draft,
                                             response_format=response_format)]


def test_greedy_json_equals_plain_constrained_decoding_on_a_head_s_trees(smollm):
    """SmolLM2 with its shipped EAGLE head: trees masked node by node; a schema, then any object."""
    model, tokenizer = smollm
    prompt = chat_tokens(tokenizer, [{"role": "user", "content": "Ada Lovelace as JSON: name, born, fields."}])
    for response_format in ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                            {"type": "json_object"}):
        got = speculative(model, tokenizer, prompt, response_format, "auto", 60)
        assert got == plain_constrained(model, tokenizer, prompt, response_grammar(response_format), 60)
        assert len(got) > 20


def test_greedy_json_equals_plain_constrained_decoding_on_qwen(qwen_coder):
    """Qwen2.5-Coder-0.5B with context drafts and forced tokens."""
    model, tokenizer = qwen_coder
    prompt = chat_tokens(tokenizer, [{"role": "user", "content": "Give Ada Lovelace's name, birth year and fields "
                                                                 "as JSON."}])
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    got = speculative(model, tokenizer, prompt, response_format, "auto", 24)
    assert got == plain_constrained(model, tokenizer, prompt, response_grammar(response_format), 24)


@pytest.mark.parametrize("response_format, says", [
    ({"type": "json"}, "response_format.type must be"),
    ("json", "response_format must be an object"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "integr"}}}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": 3}}},
     "response_format.json_schema.schema"),
])
def test_a_bad_response_format_gets_one_line_naming_it(response_format, says):
    with pytest.raises(UserError, match=says) as raised:
        response_grammar(response_format)
    assert raised.value.field == "response_format" and "\n" not in str(raised.value)


def test_a_schema_file_that_is_not_json_is_named():
    with pytest.raises(UserError, match="schema.json is not JSON"):
        schema_grammar("{not json", "schema.json")


def test_a_reply_held_to_json_ends_with_the_value_on_the_default_model(smollm):
    """SmolLM2 does not choose the end by itself after a JSON value: the grammar's end must
    allow the end of sequence alone (the engine says "stopped" as soon as only that can
    follow), or the reply runs on as prose ('{}\n\nAnn is a 28-year-old...')."""
    model, tokenizer = smollm
    prompt = chat_tokens(tokenizer, [{"role": "user", "content": "Give me data about a person named Ann."}])
    for response_format in ({"type": "json_object"},
                            {"type": "json_schema", "json_schema": {"name": "person", "schema": {
                                "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                                 "age": {"type": "integer"}},
                                "required": ["name", "age"], "additionalProperties": False}}}):
        responses = list(stream_generate(model, tokenizer, prompt, max_tokens=40, response_format=response_format))
        json.loads("".join(r.text for r in responses))
        assert responses[-1].finish_reason == "stop"
        assert [r.token for r in responses] == plain_constrained(model, tokenizer, prompt,
                                                                 response_grammar(response_format), 40)
