"""A decoder built by hand, as the tests drive it: a head's tree and context lookup
merged through the drafter seam, as plan_drafts would merge them; and greedy decoding
through any drafter; and a verify pass's logits perturbed as another kernel's rounding
might perturb them."""

from typing import Optional

import mlx.core as mx

from mlx_eagle.decoder import SpeculativeDecoder
from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.eagle import EagleDrafter
from mlx_eagle.trees import parse_tree
from mlx_eagle.verify import Sampling


def decoder(model, head, tree, sampling, seed: Optional[int] = None, lookup=None, cache=None, **settings):
    """``head`` drafting ``tree`` (a spec or its text; none: no head), and the lookup
    drafter ``lookup``, if given; ``settings`` as SpeculativeDecoder takes them."""
    spec = parse_tree(tree) if isinstance(tree, str) else tree
    drafters = [EagleDrafter(head, model, spec)] if head is not None and spec.kind != "none" else []
    drafters += [lookup] if lookup is not None else []
    drafter = None if not drafters else drafters[0] if len(drafters) == 1 else Composite(drafters)
    return SpeculativeDecoder(model, drafter, sampling, seed=seed, cache=cache, **settings)


def decode(model, drafter, prompt, count):
    """``count`` greedy tokens after ``prompt`` through ``drafter``'s rounds, and the decoder."""
    decoding = SpeculativeDecoder(model, drafter, Sampling())
    tokens = [decoding.prefill(prompt)]
    while len(tokens) < count:
        tokens += decoding.round(count - len(tokens)).tokens
    return tokens[:count], decoding


def swap_close_calls(logits: mx.array, tolerance: float) -> mx.array:
    """``logits`` [rows, vocab] with every row's top two swapped where they lie within
    ``tolerance``: what another kernel's rounding might do to a near tie."""
    top = mx.topk(logits, 2, axis=-1)
    first, second = mx.max(top, axis=-1), mx.min(top, axis=-1)
    close = (first - second <= tolerance)[:, None]
    winner, runner = logits == first[:, None], logits == second[:, None]
    return mx.where(close & winner, second[:, None], mx.where(close & runner, first[:, None], logits))
