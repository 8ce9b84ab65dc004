"""Sampling is exact: on a six_token_model model with a 6-token vocabulary, the first three generated
tokens over many seeds follow the target's exact joint distribution (chi-square, fixed
seeds), with a good draft and with a deliberately wrong one."""

from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from mlx_eagle.drafters.draft_model import DraftModelDrafter
from mlx_eagle.trees import DraftTree
from mlx_eagle.verify import Sampling
from oracle import FixedDraft
from sampling_checks import SAMPLES, VOCAB, chi_square_ok, exact_joint, sample_first_three



SETTINGS = {"temp 1": Sampling(temp=1.0), "temp 0.7, top-p 0.9, top-k 4, min-p 0.05":
            Sampling(temp=0.7, top_p=0.9, top_k=4, min_p=0.05)}


def test_first_tokens_follow_the_target_distribution(six_token_model):
    """The decoder's tree path end to end (a head's static tree, verified eagerly): the
    first three tokens over many seeds. The other paths each have one such check below
    (compiled rounds, a recurrent state rolled back, duplicate siblings in test_admit);
    the acceptance step itself, for every tree shape the drafters propose, is checked
    exactly against its analytic distribution (test_the_acceptance_step_is_exact)."""
    sampling = SETTINGS["temp 0.7, top-p 0.9, top-k 4, min-p 0.05"]
    joint = exact_joint(six_token_model, sampling)
    likely = list(np.argsort(-joint.sum(axis=(0, 2))))  # by how often t2 is each token
    counts, accepted = sample_first_three(six_token_model, FixedDraft(likely, VOCAB), sampling)
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 3  # drafts were really accepted, the test bites
    # and the statistic can fail: the same counts against a slightly different distribution
    assert not chi_square_ok(counts, exact_joint(six_token_model, Sampling(temp=0.8, top_p=0.9, top_k=4, min_p=0.05)))


def walk_distribution(tree: DraftTree, tokens: List[int], probs: np.ndarray) -> Dict[Tuple[int, ...], float]:
    """What the acceptance walk emits (accepted tokens, then the bonus), exactly: at each
    node its children are tried in order and a child holding token x is accepted with the
    target's p(x) (the mass left after its earlier siblings' rejection cancels out), none
    for a repeat of an earlier sibling's token or an id outside the vocabulary; else the
    bonus is drawn from p with every child's token removed."""
    children: Dict[int, List[int]] = {}
    for node, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(node)
    result: Dict[Tuple[int, ...], float] = {}

    def walk(node: int, emitted: Tuple[int, ...], chance: float) -> None:
        p = probs[node + 1]
        seen: set = set()
        for child in children.get(node, []):
            token = tokens[child]
            if 0 <= token < len(p) and token not in seen:
                seen.add(token)
                walk(child, emitted + (token,), chance * p[token])
        rest = p.copy()
        rest[list(seen)] = 0.0
        for token in range(len(p)):
            if rest[token] > 0:
                result[emitted + (token,)] = result.get(emitted + (token,), 0.0) + chance * rest[token]

    walk(-1, (), 1.0)
    return result


# Tree shapes the drafters propose: a chain (draft models, DFlash blocks, lookup, MTP
# chains), a static tree (heads, MTP trees), a merged tree with a lookup branch and, as a
# hostile drafter may send them on the device, a repeated sibling and an id outside.
WALKS = {
    "chain": ([2, 4, 1], [-1, 0, 1]),
    "static tree": ([2, 4, 1, 3, 5, 0], [-1, -1, 0, 0, 1, 2]),
    "merged, repeated and outside": ([2, 2, 9, 4, 1, 1, 3], [-1, -1, -1, -1, 0, 0, 3]),
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("shape", WALKS)
def test_the_acceptance_step_is_exact(setting, shape):
    from mlx_eagle.verify import accept

    sampling = SETTINGS[setting]
    tokens, parents = WALKS[shape]
    tree = DraftTree([], parents, [0] * len(parents))
    table = np.array(mx.random.normal((1 + len(tokens), VOCAB), key=mx.random.key(len(tokens))))
    for token, parent in zip(tokens, parents):
        if token < VOCAB:
            table[parent + 1, token] += 2.0  # drafts the target finds likely: the walk goes deep
    logits = mx.array(table)
    exact = walk_distribution(tree, tokens, np.array(sampling.probabilities(logits)).astype(np.float64))
    outcomes = sorted(exact)
    counts = np.zeros(len(outcomes))
    for seed in range(SAMPLES):
        verdict = accept(tree, mx.array(tokens, dtype=mx.int32), logits, sampling, seed)
        counts[outcomes.index(tuple(verdict.tokens + [verdict.bonus]))] += 1
    assert chi_square_ok(counts, np.array([exact[o] for o in outcomes]))
    assert sum(count for outcome, count in zip(outcomes, counts) if len(outcome) > 1) > SAMPLES / 10  # accepted


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


def test_hybrid_models_keep_the_target_distribution():
    """A hybrid target's recurrent state rolled back after every partly rejected chain
    (the target drafting for itself: its argmax, rejected where the sample differs): the
    decoder's rollback path."""
    import hybrids

    model = hybrids.build("lfm2", vocab_size=VOCAB)
    sampling = SETTINGS["temp 1"]
    joint = exact_joint(model, sampling)
    counts, accepted = sample_first_three(model, None, sampling,
                                          drafter=lambda: DraftModelDrafter(model, lambda k: 1.0, 0.0, 3))
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 10


@pytest.mark.parametrize("setting", list(SETTINGS.values()) + [Sampling(temp=0.9, top_k=3)])
def test_distribution_is_what_mlx_lm_samples(setting):
    logits = mx.random.normal((1, 12), key=mx.random.key(3)) * 2
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampler = make_sampler(setting.temp, setting.top_p, setting.min_p, top_k=setting.top_k)
    mx.random.seed(0)
    draws = np.array(sampler(mx.broadcast_to(logprobs, (20000, 12))))
    counts = np.bincount(draws, minlength=12)
    assert chi_square_ok(counts, np.array(setting.probabilities(logits[0])).astype(np.float64))


@pytest.fixture(scope="module")
def six_layer_model():
    """A six-token llama deep enough for every drafter's taps, with peaky distributions."""
    from checkpoints import tiny_target

    model = tiny_target(seed=7, vocab=VOCAB)
    model.lm_head.weight = model.lm_head.weight * 12
    mx.eval(model.parameters())
    return model


def _drafter_of_kind(kind, model, tmp_path):
    """A fresh drafter of ``kind`` for ``model`` (random weights: proposals the target often
    rejects, and sometimes accepts)."""
    from checkpoints import write_dflash, write_dspark

    from mlx_eagle.drafters import dspark
    from mlx_eagle.drafters.dflash import DFlashDrafter, load
    from mlx_eagle.drafters.eagle import EagleDrafter
    from mlx_eagle.heads import new_head
    from mlx_eagle.trees import parse_tree

    if kind == "dflash":
        directory = tmp_path / "dflash"
        if not directory.exists():
            write_dflash(directory, model, [1, 3], block=4, mask=5)
        drafted = load(directory, model)
        return lambda: DFlashDrafter(drafted, model, lambda k: 1.0)
    if kind == "dspark":  # (seed 4: its drafts are sometimes accepted, with this peaky target)
        directory = tmp_path / "dspark"
        if not directory.exists():
            write_dspark(directory, model, [1, 3], block=3, mask=5, seed=4)
        drafted = dspark.load(directory, model)
        return lambda: dspark.DSparkDrafter(drafted, model, lambda k: 1.0)
    family, tree = {"eagle-3 dynamic tree": ("eagle3", "dynamic:topk=2,depth=3,tokens=6"),
                    "eagle-1 chain": ("eagle1", "chain:3")}[kind]
    head = new_head(model, family, seed=3)
    return lambda: EagleDrafter(head, model, parse_tree(tree))


@pytest.mark.slow  # 3,000 decodes a kind
@pytest.mark.parametrize("kind", ["eagle-3 dynamic tree", "eagle-1 chain", "dflash", "dspark"])
def test_every_drafter_kind_keeps_the_target_distribution(six_layer_model, kind, tmp_path):
    """The drafter kinds with weights of their own, each drafting for real (random weights),
    sampled with the seeded Gumbel draws: the first three tokens follow the exact joint
    distribution (the oracle tree, context drafts, draft models, hybrids, compiled rounds,
    grammars, thinking budgets, batches and quantized caches have their own checks)."""
    sampling = SETTINGS["temp 1"]
    joint = exact_joint(six_layer_model, sampling)
    counts, accepted = sample_first_three(six_layer_model, None, sampling,
                                          drafter=_drafter_of_kind(kind, six_layer_model, tmp_path))
    assert chi_square_ok(counts, joint)
    assert accepted > 0  # its drafts were verified and some accepted
