"""Lossless decoding on the real SmolLM2-135M-Instruct in float32: every tree, both head
families, random heads, an oracle head and the shipped trained head give exactly plain
mlx-lm's greedy tokens."""

import itertools
import json
from pathlib import Path

import pytest

import mlx_eagle
from mlx_eagle import stream_generate
from mlx_eagle.plan import load_draft
from mlx_eagle.drafters.calibrate import auto_tree, tree_file
from mlx_eagle.costs import device_key
from mlx_eagle.heads import new_head
from oracle import OracleHead
from plain import plain_tokens

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning, my friend' into Spanish.",
    "List three prime numbers greater than 50.",
    "Write a Python function that reverses a string.",
    "Say just the word 'yes'.",
    "What is 17 times 23?",
    "Give me a tip for sleeping better.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
]
TREES = ["chain:4", "static:default", "dynamic:topk=4,depth=4,tokens=12"]
MAX_TOKENS = 48  # five of the prompts end on EOS before it, the others run to it


@pytest.fixture(scope="module")
def references(smollm):
    """Plain mlx-lm greedy decoding: prompt ids and the tokens up to EOS or MAX_TOKENS."""
    model, tokenizer = smollm
    result = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        result.append((ids, plain_tokens(model, ids, MAX_TOKENS, tokenizer.eos_token_ids)))
    assert any(tokens[-1] in tokenizer.eos_token_ids for _, tokens in result), "no prompt ends on EOS"
    assert any(len(tokens) == MAX_TOKENS for _, tokens in result)
    return result


def _decode(smollm, ids, head, tree, lookup=True):
    model, tokenizer = smollm
    responses = list(stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS, draft=head, tree=tree,
                                     lookup=lookup))
    return [r.token for r in responses], responses[-1]


# Random heads draft garbage, rejected round after round (a tree verified per token): each
# (family, tree) pair gets a prompt of its own, and half the reply length.
COMBOS = list(itertools.product(["eagle1", "eagle3"], TREES))
RANDOM_TOKENS = MAX_TOKENS // 2


@pytest.mark.parametrize("index", range(len(COMBOS)))
def test_random_heads_keep_greedy_output(smollm, references, index):
    family, tree = COMBOS[index]
    head = new_head(smollm[0], family, draft_vocab_size=8192 if family == "eagle3" else None, seed=index)
    ids, expected = references[index]
    model, tokenizer = smollm
    tokens = [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=RANDOM_TOKENS, draft=head, tree=tree)]
    assert tokens == expected[:RANDOM_TOKENS], (family, tree)


@pytest.mark.parametrize("tree", TREES)
def test_oracle_head_keeps_greedy_output(smollm, references, tree):
    """Long accepted paths, through second branches: every prompt, each under one of the trees."""
    model, _ = smollm
    taus = []
    for ids, expected in references[TREES.index(tree)::len(TREES)]:
        head = OracleHead(ids + expected, model.args.vocab_size)
        tokens, last = _decode(smollm, ids, head, tree)
        assert tokens == expected, tree
        taus.append(last.tokens_per_forward)
    assert min(taus) > 1.5, taus  # the oracle's drafts were really accepted


@pytest.mark.parametrize("index", [0, 6])
def test_plain_decoding_through_the_same_loop(smollm, references, index):
    ids, expected = references[index]
    tokens, last = _decode(smollm, ids, None, None, lookup=False)
    assert tokens == expected and last.tokens_per_forward == 1.0



@pytest.fixture(scope="module")
def shipped(smollm):
    head = load_draft("auto", smollm[0])
    assert head is not None, "no head shipped for the default model"
    return head


def test_the_shipped_head_is_found_by_default(shipped):
    assert shipped.family == "eagle3"
    assert shipped.directory == Path(mlx_eagle.__file__).parent / "weights" / "SmolLM2-135M-Instruct"
    size = sum(path.stat().st_size for path in shipped.directory.rglob("*") if path.is_file())
    assert size <= 25 * 2 ** 20, size


def test_the_shipped_head_keeps_greedy_output(smollm, references, shipped):
    taus = []
    for ids, expected in references:
        tokens, last = _decode(smollm, ids, shipped, "static:default")
        assert tokens == expected
        taus.append(last.tokens_per_forward)
    # a random head's drafts are almost never accepted (tau ~1.0); a trained one's are
    assert sum(taus) / len(taus) > 1.3, taus


@pytest.mark.parametrize("tree", ["static:default", "dynamic:topk=4,depth=4,tokens=12"])  # (a chain is a static tree)
def test_compiled_and_eager_rounds_are_identical(smollm, references, shipped, tree, monkeypatch, compiling):
    """Compiled rounds (the head's read of the committed tokens and a static draft one
    call, a dynamic tree's depths one call each, the verify pass one call per bucket of
    block sizes) propose exactly the trees eager rounds propose, round by round, and the
    decoder commits exactly mlx-lm's tokens both ways."""
    from drafting import decoder as make_decoder
    from mlx_eagle import compiled as compiling_module, decoder as decoding
    from mlx_eagle.drafters.tree_growth import TreeDrafter
    from mlx_eagle.trees import parse_tree
    from mlx_eagle.verify import Sampling

    model, _ = smollm
    ids, expected = references[2]
    verified = []
    monkeypatch.setattr(decoding, "verify_block",
                        lambda *args: verified.append(1) or compiling_module.verify_block(*args))
    runs = []
    for compiled in (True, False):
        compiling(compiled)
        decoder = make_decoder(model, shipped, tree, Sampling())
        drafter = decoder.drafter
        drafter.grower = TreeDrafter(shipped, model, parse_tree(tree), compiled=compiled)
        assert (drafter.grower.compiled or drafter.grower.compiled_expand) is not None if compiled else \
            drafter.grower.compiled is drafter.grower.compiled_expand is None
        proposals = []

        def recorded(budget, propose=drafter.propose, proposals=proposals):
            proposals.append(propose(budget))
            return proposals[-1]

        drafter.propose = recorded
        tokens = [decoder.prefill(ids)]
        while len(tokens) < len(expected):
            tokens += decoder.round(len(expected) - len(tokens)).tokens
        assert tokens[:len(expected)] == expected
        runs.append([p.tokens.tolist() if p is not None else None for p in proposals])
        assert len(verified) == (decoder.forwards - 1 if compiled else 0)  # every round verified compiled, or none
        verified.clear()
    assert runs[0] == runs[1] and sum(p is not None for p in runs[0]) > 5


def test_auto_follows_the_shipped_tree_file(smollm, shipped):
    model, _ = smollm
    spec, why = auto_tree(model, shipped)
    path = tree_file(shipped.directory, device_key(model))
    if not path.exists():  # a device nobody tuned for: built from the head's recorded acceptance
        assert why.startswith(f"calibrated for {device_key(model)} (acceptance recorded in"), why
        return
    assert len(spec.paths) == len(json.loads(path.read_text())["paths"]), why
    assert why.startswith(f"tuned for {device_key(model)}")
