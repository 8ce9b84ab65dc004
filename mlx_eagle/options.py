"""What one reply varies by, typed and checked once: ``ReplyOptions``, as vLLM's
``SamplingParams`` are. Every way in builds one (stream_generate's and batch_generate's
keyword arguments, ``Engine.generate``, each server protocol's parser) and everything below
reads it. What an engine is set up with (KV quantization, tree, context drafts, history)
lies apart, in the engine and the draft plan.

A new per-request option is a field here (with its check), its use where the reply is made
(generation.Generation), and its request field in the protocols that offer it."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional, Sequence, Tuple

from .errors import MAX_SEED, UserError, check_text, did_you_mean
from .grammar import response_grammar
from .thinking import check_budget
from .verify import Sampling

DEFAULT_MAX_TOKENS = 256  # stream_generate's and Engine.generate's, as mlx-lm's stream_generate


@dataclass(frozen=True)
class ReplyOptions:
    """One reply's settings. ``max_tokens``: its length at most; ``temp``, ``top_p``,
    ``min_p``, ``top_k``: the sampling (mlx-lm's make_sampler's; temp 0: greedy); ``seed``:
    the sampling noise (None: drawn); ``stop``: strings that end the reply (not shown);
    ``stop_tokens``: token ids that end it as the end of sequence does (a
    fill-in-the-middle prompt's); ``logprobs``: each response carries the target's
    log-probabilities; ``response_format``: a grammar the reply is held to
    (mlx_eagle.grammar); ``thinking_budget``: a reasoning model's thinking ended after this
    many tokens (mlx_eagle.thinking). Made, it is checked: the first setting that cannot be
    meant raises a UserError naming it (``field``)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Tuple[str, ...] = ()
    stop_tokens: Tuple[int, ...] = ()
    logprobs: bool = False
    response_format: Optional[Mapping[str, Any]] = None
    thinking_budget: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UserError(f"max_tokens must be a whole number, 1 or more, not {self.max_tokens!r}", "max_tokens")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
            raise UserError(f"seed must be a whole number from 0 to {MAX_SEED}, not {seed!r}", "seed")
        Sampling(self.temp, self.top_p, self.min_p, self.top_k)  # (its own checks)
        object.__setattr__(self, "stop", _strings(self.stop))
        object.__setattr__(self, "stop_tokens", _token_ids(self.stop_tokens))
        if not isinstance(self.logprobs, bool):
            raise UserError(f"logprobs must be true or false, not {self.logprobs!r}", "logprobs")
        response_grammar(self.response_format)
        check_budget(self.thinking_budget)

    @classmethod
    def of(cls, **settings: Any) -> "ReplyOptions":
        """The options ``settings`` name (keyword arguments, as the API takes them): one line
        for a name that is no reply setting."""
        known = [f.name for f in fields(cls)]
        for name in settings:
            if name not in known:
                raise UserError(f"{name!r} is not a reply setting{did_you_mean(name, known)}; the settings are "
                                f"{', '.join(known)}", name)
        return cls(**settings)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temp, self.top_p, self.min_p, self.top_k)

    def but(self, **changes: Any) -> "ReplyOptions":
        """These options with ``changes`` (checked again)."""
        return replace(self, **changes)


def _strings(stop: Any) -> Tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(text, str) for text in stop):
        raise UserError(f"stop must be a string or a list of strings, not {stop!r}", "stop")
    return tuple(check_text(text, "stop") for text in stop)


def _token_ids(ids: Optional[Sequence[int]]) -> Tuple[int, ...]:
    ids = tuple(ids or ())
    if not all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in ids):
        raise UserError(f"stop_tokens must be token ids (whole numbers, 0 or more), not {list(ids)!r}", "stop_tokens")
    return ids
