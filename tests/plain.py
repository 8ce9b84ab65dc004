"""Plain decoding: the reference every decoding path is checked against, mlx-lm's own greedy
loop (``generate_step``, no prompt cache), written once and memoized per model object and
request, so that tests asking the same question share one answer; and kept on disk (the
user cache's references/, conftest.py), keyed by everything the answer depends on (the
model's configuration and a sample of its weights, MLX's and mlx-lm's versions, the device,
its BLAS and BLAS threads, the request), so that a machine computes each once, not every run
(they are a quarter of the suite's decoding)."""

import hashlib
import importlib.metadata
import json
import os
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from mlx_eagle.costs import device_key
from mlx_eagle.files import cache_dir, read_json, write_json

# Every this-many-th weight of each tensor enters a model's key (and its first ones): enough to
# tell any two models the tests make apart, at a small part of hashing them whole.
WEIGHT_STRIDE = 101


class Plain(NamedTuple):
    tokens: List[int]
    first_logprob: float  # the first token's log-probability: what reading the prompt decides


# id(model) -> (the model, kept so that its id is not reused; its key; its answers)
_ANSWERS: Dict[int, Tuple[object, str, Dict[tuple, Plain]]] = {}


def _model_key(model) -> str:
    digest = hashlib.sha256(json.dumps(vars(model.args), sort_keys=True, default=str).encode())
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda item: item[0]):
        flat = value.reshape(-1)
        sample = mx.concatenate([flat[:64], flat[::WEIGHT_STRIDE]])
        digest.update(f"{name} {value.shape} {value.dtype}".encode())
        digest.update(np.array(sample.astype(mx.float32) if sample.dtype == mx.bfloat16 else sample).tobytes())
    versions = [importlib.metadata.version(package) for package in ("mlx", "mlx-lm")]
    digest.update(json.dumps([versions, device_key(model), os.environ.get("OPENBLAS_NUM_THREADS")]).encode())
    return digest.hexdigest()[:32]


def plain(model, ids: Iterable[int], max_tokens: int, eos: Iterable[int] = (),
          kv: Optional[Dict[str, int]] = None) -> Plain:
    """mlx-lm's greedy decoding of ``ids``: ``max_tokens`` tokens, or up to and including
    the first in ``eos``; ``kv``: its quantized-cache arguments (kv_bits, kv_group_size,
    quantized_kv_start)."""
    ids, eos, kv = [int(t) for t in ids], frozenset(int(t) for t in eos), dict(kv or {})
    key = (tuple(ids), max_tokens, eos, tuple(sorted(kv.items())))
    known = _ANSWERS.get(id(model))
    if known is None or known[0] is not model:
        known = _ANSWERS[id(model)] = (model, _model_key(model), {})
    _, model_key, answers = known
    if key not in answers:
        request = json.dumps([model_key, key[0], max_tokens, sorted(eos), key[3]])
        path = cache_dir() / "references" / f"{hashlib.sha256(request.encode()).hexdigest()[:32]}.json"
        try:
            kept = read_json(path)
            answers[key] = Plain([int(t) for t in kept["tokens"]], float(kept["first_logprob"]))
        except (ValueError, KeyError, TypeError):  # (not kept yet, or damaged: computed again)
            tokens, first = [], None
            for (token, logprobs), _ in zip(generate_step(mx.array(ids), model, max_tokens=max_tokens, **kv),
                                            range(max_tokens)):
                tokens.append(int(token))
                first = float(logprobs[tokens[0]]) if first is None else first
                if tokens[-1] in eos:
                    break
            answers[key] = Plain(tokens, first)
            write_json(path, {"tokens": tokens, "first_logprob": first})
    return Plain(list(answers[key].tokens), answers[key].first_logprob)


def plain_tokens(model, ids: Iterable[int], max_tokens: int, eos: Iterable[int] = (),
                 kv: Optional[Dict[str, int]] = None) -> List[int]:
    """plain(...)'s tokens."""
    return plain(model, ids, max_tokens, eos, kv).tokens


def reference_matcher(tokenizer, grammar: str, vocab: int) -> llguidance.LLMatcher:
    """A matcher of its own, beside the runtime's."""
    return llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=vocab,
                                                             eos_token=sorted(tokenizer.eos_token_ids)), grammar)


def plain_constrained(model, tokenizer, prompt: List[int], grammar: str, max_tokens: int) -> List[int]:
    """mlx-lm's own loop, greedy, with the grammar's mask as a logits processor."""
    matcher = reference_matcher(tokenizer, grammar, model.args.vocab_size)

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size > len(prompt):
            matcher.consume_token(int(tokens[-1].item()))
        values = np.array(logits.astype(mx.float32))
        llguidance.numpy.apply_token_bitmask_inplace(values, np.frombuffer(matcher.compute_bitmask(),
                                                                           dtype=np.int32)[None].copy())
        return mx.array(values)

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                  sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
                                  logits_processors=[processor]):
        out.append(int(token))
        if int(token) in tokenizer.eos_token_ids:
            break
    return out
