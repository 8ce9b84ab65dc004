"""The target's states for training draft heads, cached on disk in float16 shards.

Every token gets the EAGLE-3 taps (the states entering three layers) and the post-norm
last state, which is the EAGLE-1 feature and, through the target's LM head, its
next-token probabilities. Shard i of features/ holds the sequences of shard i of data/.

Self-distillation makes the answers and their states in one pass: a batch of prompts is
answered greedily, and every state the forward passes compute is kept. Prompts in a
batch differ in length; rather than pad, every sequence is fed its own prompt tokens
until its prompt ends (teacher forcing inside the batch), so all share one position
counter and the plain causal mask. Prompts sorted by length keep that overlap short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .data import save_shard, shard_path
from .target import lm_head, target_forward

Sequences = List[Tuple[np.ndarray, int]]  # (token ids, prompt length)


def features_path(directory: Path, index: int) -> Path:
    return directory / f"features-{index:05d}.npz"


def save_features(path: Path, tokens: Sequence[np.ndarray], prompt_lengths: Sequence[int],
                  taps: Sequence[np.ndarray], last: Sequence[np.ndarray]) -> None:
    """One shard, written atomically."""
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, lengths=np.array([len(t) for t in tokens], dtype=np.int32),
             prompt_lengths=np.array(prompt_lengths, dtype=np.int32), tokens=np.concatenate(tokens).astype(np.int32),
             taps=np.concatenate(taps).astype(np.float16), last=np.concatenate(last).astype(np.float16))
    partial.replace(path)


def compute_features(model: nn.Module, sequences: Sequences, out: Path, taps: Sequence[int], seq_len: int,
                     shard_size: int = 32, progress: bool = True) -> None:
    """Features of given sequences (ShareGPT's own answers), ``shard_size`` per shard, resumable."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    count = (len(sequences) + shard_size - 1) // shard_size
    todo = [i for i in range(count) if not features_path(out, i).exists()]
    bar = tqdm(total=count, initial=count - len(todo), unit="shard", desc="target features", disable=not progress)
    for index in todo:
        columns: Dict[str, list] = {"tokens": [], "prompt_lengths": [], "taps": [], "last": []}
        for tokens, prompt_length in sequences[index * shard_size:(index + 1) * shard_size]:
            tokens = np.asarray(tokens[:seq_len], dtype=np.int32)
            state = target_forward(model, mx.array(tokens)[None], make_prompt_cache(model), 0, "causal", taps)
            columns["tokens"].append(tokens)
            columns["prompt_lengths"].append(min(prompt_length, len(tokens)))
            columns["taps"].append(np.array(state.features[0].astype(mx.float16)))
            columns["last"].append(np.array(state.hidden[0].astype(mx.float16)))
        save_features(features_path(out, index), **columns)
        bar.update(1)
    bar.close()


def greedy_batch(model: nn.Module, prompts: Sequence[Sequence[int]], max_answer_tokens: int,
                 eos_ids: Sequence[int], taps: Sequence[int]):
    """Answer ``prompts`` greedily together. Returns per sequence (token ids, taps, last):
    the prompt and answer (ending with EOS unless cut at ``max_answer_tokens``) and the
    states of every one of those tokens."""
    eos = set(eos_ids)
    sequences = [list(p) for p in prompts]
    prompt_lengths = [len(p) for p in prompts]
    generating = [True] * len(prompts)
    cache = make_prompt_cache(model)
    fed = min(prompt_lengths)
    state = target_forward(model, mx.array([s[:fed] for s in sequences]), cache, 0, "causal", taps)
    kept_taps, kept_last = [state.features.astype(mx.float16)], [state.hidden.astype(mx.float16)]
    while True:
        # Only the last position's logits: the full-vocabulary head is the costliest layer.
        choice = mx.argmax(lm_head(model, state.hidden[:, -1]), axis=-1)
        mx.async_eval(choice, kept_taps[-1], kept_last[-1])
        for b, token in enumerate(choice.tolist()):
            if generating[b] and fed == len(sequences[b]):
                sequences[b].append(token)
                if token in eos or len(sequences[b]) - prompt_lengths[b] >= max_answer_tokens:
                    generating[b] = False
        if not any(generating) and all(fed >= len(s) for s in sequences):
            break
        step = mx.array([[s[fed] if fed < len(s) else 0] for s in sequences])
        state = target_forward(model, step, cache, fed, None, taps)
        kept_taps.append(state.features.astype(mx.float16))
        kept_last.append(state.hidden.astype(mx.float16))
        fed += 1
    all_taps = np.array(mx.concatenate(kept_taps, axis=1))
    all_last = np.array(mx.concatenate(kept_last, axis=1))
    return [(np.array(s, dtype=np.int32), all_taps[b, :len(s)], all_last[b, :len(s)])
            for b, s in enumerate(sequences)]


def self_distill(model: nn.Module, tokenizer, prompts: Sequence[str], data: Path, features: Path,
                 taps: Sequence[int], shard_size: int = 32, max_prompt_tokens: int = 256,
                 max_answer_tokens: int = 256, first_shard: int = 0, progress: bool = True) -> int:
    """Regenerate answers with the target (greedy) and keep their features, ``shard_size``
    prompts per shard, numbered from ``first_shard`` (more prompts for data made before);
    prompts longer than ``max_prompt_tokens`` are skipped (cutting one would cut off the
    chat template's generation prompt). Finished shards are skipped, so an interrupted
    run resumes where it stopped. Returns the number of the shard after the last."""
    from tqdm import tqdm

    data.mkdir(parents=True, exist_ok=True)
    features.mkdir(parents=True, exist_ok=True)
    encoded = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in prompts]
    encoded = sorted((ids for ids in encoded if len(ids) <= max_prompt_tokens), key=len)
    count = (len(encoded) + shard_size - 1) // shard_size
    todo = [i for i in range(count)
            if not (shard_path(data, first_shard + i).exists() and features_path(features, first_shard + i).exists())]
    bar = tqdm(total=len(encoded), initial=(count - len(todo)) * shard_size, unit="answer",
               desc="self-distillation", disable=not progress)
    tokens_made = 0
    for i in todo:
        batch, index = encoded[i * shard_size:(i + 1) * shard_size], first_shard + i
        answered = greedy_batch(model, batch, max_answer_tokens, tokenizer.eos_token_ids, taps)
        save_features(features_path(features, index), [t for t, _, _ in answered], [len(p) for p in batch],
                      [f for _, f, _ in answered], [h for _, _, h in answered])
        save_shard(shard_path(data, index), [(list(p), list(t[len(p):])) for p, (t, _, _) in zip(batch, answered)])
        tokens_made += sum(len(t) - len(p) for p, (t, _, _) in zip(batch, answered))
        bar.update(len(batch))
        bar.set_postfix(answer_tokens=tokens_made)
    bar.close()
    return first_shard + count


def load_features(directory: Path, seq_len: Optional[int] = None) -> List[Dict[str, np.ndarray]]:
    """One dict per sequence (tokens, taps, last, prompt_length), cut to ``seq_len`` tokens."""
    result = []
    for path in sorted(Path(directory).glob("features-*.npz")):
        if path.name.endswith(".partial.npz"):
            continue
        with np.load(path) as data:  # each key read once: an NpzFile re-reads a key on every access
            columns = {key: data[key] for key in ("lengths", "prompt_lengths", "tokens", "taps", "last")}
        starts = np.concatenate([[0], np.cumsum(columns["lengths"])])
        for i, prompt_length in enumerate(columns["prompt_lengths"]):
            span = slice(starts[i], starts[i] + min(columns["lengths"][i], seq_len or columns["lengths"][i]))
            result.append({"tokens": columns["tokens"][span], "taps": columns["taps"][span],
                           "last": columns["last"][span], "prompt_length": int(prompt_length)})
    return result
