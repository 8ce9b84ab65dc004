"""Sampling is exact: on a six_token_model model with a 6-token vocabulary, the first three generated
tokens over many seeds follow the target's exact joint distribution (chi-square, fixed
seeds), with a good draft and with a deliberately wrong one."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_sampler

from drafting import decoder as make_decoder
from mlx_eagle.decoder import SpeculativeDecoder
from mlx_eagle.drafters.draft_model import DraftModelDrafter
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.trees import TreeSpec
from mlx_eagle.verify import Sampling
from oracle import FixedDraft

pytestmark = pytest.mark.slow  # thousands of seeded decodes

VOCAB = 6
PROMPT = [1, 4, 2]
TREE = TreeSpec("static", [(0,), (1,), (0, 0), (0, 1), (1, 0)], text="test")
SAMPLES = 3000


def exact_joint(model, sampling: Sampling, prompt=PROMPT) -> np.ndarray:
    """p(t1, t2, t3 | prompt) from plain forward passes."""
    def next_probs(context):
        return np.array(sampling.probabilities(model(mx.array([context]))[0, -1])).astype(np.float64)

    joint = np.zeros((VOCAB,) * 3)
    p1 = next_probs(prompt)
    for t1 in range(VOCAB):
        p2 = next_probs(prompt + [t1])
        for t2 in range(VOCAB):
            joint[t1, t2] = p1[t1] * p2[t2] * next_probs(prompt + [t1, t2])
    return joint


def chi_square_ok(counts: np.ndarray, expected_probs: np.ndarray) -> bool:
    expected = expected_probs.ravel() * counts.sum()
    counts = counts.ravel()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    keep = wanted > 0
    stat = (((observed - wanted) ** 2)[keep] / wanted[keep]).sum()
    dof = keep.sum() - 1
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # Wilson-Hilferty, p = 0.001
    return stat < critical


def sample_first_three(model, draft, sampling: Sampling, lookup: bool = False, prompt=PROMPT, drafter=None):
    """Counts of the first three tokens over SAMPLES seeds. ``lookup``: graft context
    drafts onto every tree (a flat cost curve: always as long as they reach). ``drafter``:
    makes the drafter of each decode instead (``draft`` and ``lookup`` unused)."""
    counts = np.zeros((VOCAB,) * 3)
    drafted_tokens = accepted_tokens = 0
    for seed in range(SAMPLES):
        if drafter is not None:
            decoder = SpeculativeDecoder(model, drafter(), sampling, seed=seed)
        else:
            lookups = LookupDrafter(lambda tokens: 1.0, max_tokens=3) if lookup else None
            decoder = make_decoder(model, draft, TREE, sampling, seed=seed, lookup=lookups)
        tokens = [decoder.prefill(prompt)]
        while len(tokens) < 3:
            result = decoder.round(3 - len(tokens))
            tokens += result.tokens
            drafted_tokens += result.drafted
            accepted_tokens += len(result.tokens) - 1
        counts[tuple(tokens[:3])] += 1
    return counts, accepted_tokens


SETTINGS = {"temp 1": Sampling(temp=1.0), "temp 0.7, top-p 0.9, top-k 4, min-p 0.05":
            Sampling(temp=0.7, top_p=0.9, top_k=4, min_p=0.05)}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("quality", ["good", "wrong"])
def test_first_tokens_follow_the_target_distribution(six_token_model, setting, quality):
    sampling = SETTINGS[setting]
    joint = exact_joint(six_token_model, sampling)
    likely = list(np.argsort(-joint.sum(axis=(0, 2))))  # by how often t2 is each token
    draft = FixedDraft(likely if quality == "good" else likely[::-1], VOCAB)
    counts, accepted = sample_first_three(six_token_model, draft, sampling)
    assert chi_square_ok(counts, joint)
    if quality == "good":
        assert accepted > SAMPLES / 3  # drafts were really accepted, the test bites


def test_compiled_rounds_follow_the_target_distribution(six_token_model, monkeypatch, compiling):
    """Rounds verified in one compiled call (the default where MLX runs on a GPU), a tree
    and context drafts merged: the same distribution."""
    from mlx_eagle import compiled, decoder as decoding

    compiling(True)
    blocks = []
    monkeypatch.setattr(decoding, "verify_block", lambda model, tokens, *args: blocks.append(tokens.size) or
                        compiled.verify_block(model, tokens, *args))
    sampling = SETTINGS["temp 0.7, top-p 0.9, top-k 4, min-p 0.05"]
    joint = exact_joint(six_token_model, sampling)
    likely = list(np.argsort(-joint.sum(axis=(0, 2))))
    counts, accepted = sample_first_three(six_token_model, FixedDraft(likely, VOCAB), sampling, lookup=True)
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 3 and len(blocks) >= SAMPLES  # every decode verified compiled


@pytest.mark.parametrize("head", [True, False])
def test_lookup_drafts_keep_the_target_distribution(six_token_model, head):
    """Context drafts grafted onto a head's tree (a wrong head, so the lookup branch
    carries what is accepted), and lookup alone."""
    sampling = SETTINGS["temp 0.7, top-p 0.9, top-k 4, min-p 0.05"]
    prompt = [1, 5, 0, 5, 5, 0, 4, 5]  # the tokens this model favours, so the context holds its continuations
    joint = exact_joint(six_token_model, sampling, prompt)
    likely = list(np.argsort(-joint.sum(axis=(0, 2))))
    draft = FixedDraft(likely[::-1], VOCAB) if head else None
    counts, accepted = sample_first_three(six_token_model, draft, sampling, lookup=True, prompt=prompt)
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 10  # lookup drafts were really accepted


@pytest.mark.parametrize("draft", ["the target itself", "another model"])
def test_draft_model_drafts_keep_the_target_distribution(six_token_model, draft):
    """A draft model's greedy chains: the target itself (its argmax, accepted often) and a
    model with other weights (drafts that are mostly wrong)."""
    sampling = SETTINGS["temp 0.7, top-p 0.9, top-k 4, min-p 0.05"]
    drafting = six_token_model
    if draft == "another model":
        mx.random.seed(8)
        drafting = llama.Model(six_token_model.args)
        mx.eval(drafting.parameters())
    joint = exact_joint(six_token_model, sampling)
    counts, accepted = sample_first_three(six_token_model, None, sampling,
                                          drafter=lambda: DraftModelDrafter(drafting, lambda k: 1.0, 0.0, 3))
    assert chi_square_ok(counts, joint)
    if draft == "the target itself":  # drafts were really accepted, the test bites
        assert accepted > SAMPLES / 3


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_hybrid_models_keep_the_target_distribution(family):
    """A hybrid target's recurrent state rolled back after every partly rejected chain
    (the target drafting for itself: its argmax, rejected where the sample differs)."""
    import hybrids

    model = hybrids.build(family, vocab_size=VOCAB)
    sampling = SETTINGS["temp 1"]
    joint = exact_joint(model, sampling)
    counts, accepted = sample_first_three(model, None, sampling,
                                          drafter=lambda: DraftModelDrafter(model, lambda k: 1.0, 0.0, 3))
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 10


@pytest.mark.parametrize("tree", ["chain:3", "static:default"])
def test_mtp_drafts_keep_the_target_distribution(tree):
    """A MiMo target's own (random) MTP module, as chains and as trees of each depth's top
    tokens, verified by the rejection walk."""
    from test_mtp import build, mtp_tensors, new_module
    from mlx_eagle.drafters.eagle import EagleDrafter
    from mlx_eagle.drafters.mtp import module_for
    from mlx_eagle.trees import parse_tree

    model = build("mimo", vocab_size=VOCAB)
    model.lm_head.weight = model.lm_head.weight * 30  # peaky, context-dependent distributions
    module = module_for(model, mtp_tensors(new_module(model), model), "test")
    sampling = SETTINGS["temp 1"]
    joint = exact_joint(model, sampling)
    counts, accepted = sample_first_three(model, None, sampling,
                                          drafter=lambda: EagleDrafter(module, model, parse_tree(tree)))
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 10  # drafts were accepted: the walk was tested


@pytest.mark.parametrize("curve", ["flat: DDTree trees", "steep: chains"])
def test_dflash_drafts_keep_the_target_distribution(six_token_model, tmp_path, curve):
    """A random DFlash drafter's blocks, as chains and as DDTree trees (its drafts accepted
    now and then over six tokens), verified by the rejection walk."""
    from test_dflash import write_dflash
    from mlx_eagle.drafters.dflash import DFlashDrafter, load

    sizes = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "intermediate_size": 64}
    # Seed 5: its first draft is one the target often samples here, so drafts are accepted.
    write_dflash(tmp_path / "dflash", six_token_model, [0], block=4, mask=5, sizes=sizes, seed=5)
    drafting = load(tmp_path / "dflash", six_token_model)
    cost = (lambda k: 1.0) if curve.startswith("flat") else (lambda k: 1.0 + 0.2 * (k - 1))
    sampling = SETTINGS["temp 0.7, top-p 0.9, top-k 4, min-p 0.05"]
    joint = exact_joint(six_token_model, sampling)
    counts, accepted = sample_first_three(six_token_model, None, sampling,
                                          drafter=lambda: DFlashDrafter(drafting, six_token_model, cost))
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 10  # drafts were accepted: the walk was tested


def test_drafts_from_earlier_replies_keep_the_target_distribution(six_token_model):
    """A history of replies that begin like this prompt: its continuation trees are
    drafted (trees, not chains) and accepted often, and the tokens stay the target's."""
    from mlx_eagle.drafters.history import History

    sampling = SETTINGS["temp 1"]
    joint = exact_joint(six_token_model, sampling)
    history = History()
    rng = np.random.default_rng(0)
    for _ in range(60):  # replies sampled from the target's own first-token distributions, roughly
        t1, t2, t3 = np.unravel_index(rng.choice(joint.size, p=joint.ravel() / joint.sum()), joint.shape)
        history.add(PROMPT + [int(t1), int(t2), int(t3)])
    counts, accepted = sample_first_three(six_token_model, None, sampling,
                                          drafter=lambda: LookupDrafter(lambda k: 1.0, max_tokens=3, history=history))
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 10


def test_a_biased_sampler_fails_the_check(six_token_model):
    """The statistic can fail: the same counts against a slightly different distribution."""
    sampling = SETTINGS["temp 1"]
    joint = exact_joint(six_token_model, sampling)
    counts, _ = sample_first_three(six_token_model, None, sampling)
    assert chi_square_ok(counts, joint)
    assert not chi_square_ok(counts, exact_joint(six_token_model, Sampling(temp=1.3)))


@pytest.mark.parametrize("setting", list(SETTINGS.values()) + [Sampling(temp=0.9, top_k=3)])
def test_distribution_is_what_mlx_lm_samples(setting):
    logits = mx.random.normal((1, 12), key=mx.random.key(3)) * 2
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampler = make_sampler(setting.temp, setting.top_p, setting.min_p, top_k=setting.top_k)
    mx.random.seed(0)
    draws = np.array(sampler(mx.broadcast_to(logprobs, (20000, 12))))
    counts = np.bincount(draws, minlength=12)
    assert chi_square_ok(counts, np.array(setting.probabilities(logits[0])).astype(np.float64))
