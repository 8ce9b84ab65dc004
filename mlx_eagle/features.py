"""Self-distillation: ShareGPT prompts answered greedily by the target itself, in batches,
stored as token ids (the trainer recomputes the target's states for every batch).

Prompts in a batch differ in length; rather than pad, every sequence is fed its own
prompt tokens until its prompt ends (teacher forcing inside the batch), so all share one
position counter and the plain causal mask. Prompts sorted by length keep that overlap short.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .data import save_shard, shard_path
from .replies import chat_tokens
from .progress import progress_bar
from .target import lm_head, make_cache, target_forward


def greedy_batch(model: nn.Module, prompts: Sequence[Sequence[int]], max_answer_tokens: int,
                 eos_ids: Sequence[int]) -> List[np.ndarray]:
    """Answer ``prompts`` greedily together. Returns per sequence its token ids: the prompt
    and the answer (ending with EOS unless cut at ``max_answer_tokens``)."""
    eos = set(eos_ids)
    sequences = [list(p) for p in prompts]
    prompt_lengths = [len(p) for p in prompts]
    generating = [True] * len(prompts)
    cache = make_cache(model)
    fed = min(prompt_lengths)
    state = target_forward(model, mx.array([s[:fed] for s in sequences]), cache, 0, "causal")
    while True:
        # Only the last position's logits: the full-vocabulary head is the costliest layer.
        choice = mx.argmax(lm_head(model, state.hidden[:, -1]), axis=-1)
        for b, token in enumerate(choice.tolist()):
            if generating[b] and fed == len(sequences[b]):
                sequences[b].append(token)
                if token in eos or len(sequences[b]) - prompt_lengths[b] >= max_answer_tokens:
                    generating[b] = False
        if not any(generating) and all(fed >= len(s) for s in sequences):
            break
        step = mx.array([[s[fed] if fed < len(s) else 0] for s in sequences])
        state = target_forward(model, step, cache, fed, None)
        fed += 1
    return [np.array(s, dtype=np.int32) for s in sequences]


def self_distill(model: nn.Module, tokenizer, prompts: Sequence[str], data: Path, shard_size: int = 32,
                 max_prompt_tokens: int = 256, max_answer_tokens: int = 256, first_shard: int = 0,
                 progress: bool = True) -> int:
    """Regenerate answers with the target (greedy), ``shard_size`` prompts per shard of
    token ids, numbered from ``first_shard`` (more prompts for data made before); prompts
    longer than ``max_prompt_tokens`` are skipped (cutting one would cut off the chat
    template's generation prompt). Finished shards are skipped, so an interrupted run
    resumes where it stopped. Returns the number of the shard after the last."""

    data.mkdir(parents=True, exist_ok=True)
    encoded = [chat_tokens(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    encoded = sorted((ids for ids in encoded if len(ids) <= max_prompt_tokens), key=len)
    count = (len(encoded) + shard_size - 1) // shard_size
    todo = [i for i in range(count) if not shard_path(data, first_shard + i).exists()]
    bar = progress_bar(total=len(encoded), initial=(count - len(todo)) * shard_size, unit="answer",
               desc="self-distillation", disable=not progress)
    tokens_made = 0
    for i in todo:
        batch, index = encoded[i * shard_size:(i + 1) * shard_size], first_shard + i
        answered = greedy_batch(model, batch, max_answer_tokens, tokenizer.eos_token_ids)
        save_shard(shard_path(data, index), [(list(p), list(t[len(p):])) for p, t in zip(batch, answered)])
        tokens_made += sum(len(t) - len(p) for p, t in zip(batch, answered))
        bar.update(len(batch))
        bar.set_postfix(answer_tokens=tokens_made)
    bar.close()
    return first_shard + count
