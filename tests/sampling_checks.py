"""Exact sampling, checked: a model's exact joint distribution of its first three tokens,
counts of those tokens over many seeded decodes, and a chi-square test between them (the
six-token model in conftest.py, whose distributions are peaky and depend on the context)."""

import math

import mlx.core as mx
import numpy as np

from drafting import decoder as make_decoder
from mlx_eagle.decoder import SpeculativeDecoder
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.trees import TreeSpec
from mlx_eagle.verify import Sampling

VOCAB = 6
PROMPT = [1, 4, 2]
TREE = TreeSpec("static", [(0,), (1,), (0, 0), (0, 1), (1, 0)], text="test")
SAMPLES = 2000


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
