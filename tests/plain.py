"""Plain decoding: the reference every decoding path is checked against, mlx-lm's own greedy
loop (``generate_step``, no prompt cache), written once and memoized per model object and
request, so that tests asking the same question share one answer."""

from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step


class Plain(NamedTuple):
    tokens: List[int]
    first_logprob: float  # the first token's log-probability: what reading the prompt decides


# id(model) -> (the model, kept so that its id is not reused; its answers)
_ANSWERS: Dict[int, Tuple[object, Dict[tuple, Plain]]] = {}


def plain(model, ids: Iterable[int], max_tokens: int, eos: Iterable[int] = (),
          kv: Optional[Dict[str, int]] = None) -> Plain:
    """mlx-lm's greedy decoding of ``ids``: ``max_tokens`` tokens, or up to and including
    the first in ``eos``; ``kv``: its quantized-cache arguments (kv_bits, kv_group_size,
    quantized_kv_start)."""
    ids, eos, kv = [int(t) for t in ids], frozenset(int(t) for t in eos), dict(kv or {})
    key = (tuple(ids), max_tokens, eos, tuple(sorted(kv.items())))
    answers = _ANSWERS.setdefault(id(model), (model, {}))[1]
    if key not in answers:
        tokens, first = [], None
        for (token, logprobs), _ in zip(generate_step(mx.array(ids), model, max_tokens=max_tokens, **kv),
                                        range(max_tokens)):
            tokens.append(int(token))
            first = float(logprobs[tokens[0]]) if first is None else first
            if tokens[-1] in eos:
                break
        answers[key] = Plain(tokens, first)
    return Plain(list(answers[key].tokens), answers[key].first_logprob)


def plain_tokens(model, ids: Iterable[int], max_tokens: int, eos: Iterable[int] = (),
                 kv: Optional[Dict[str, int]] = None) -> List[int]:
    """plain(...)'s tokens."""
    return plain(model, ids, max_tokens, eos, kv).tokens
