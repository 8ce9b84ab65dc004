"""What a head trains on: pieces (token ids with the mask of the answer tokens), the
draft vocabulary made from them, and padded batches; from ShareGPT's own answers or
the target's (self-distilled), tokenized once into the data directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..data import dialogue_tokens, load_dialogues, load_shards, save_dialogues, sharegpt_dialogues, sharegpt_prompts
from ..errors import UserError
from ..features import self_distill
from ..files import write_atomically
from ..progress import progress_bar

# (token ids, answer) with answer[i] True where the model itself generated token i.
Piece = Tuple[np.ndarray, np.ndarray]


def draft_vocabulary(pieces: Sequence[Piece], vocab_size: int, size: int) -> np.ndarray:
    """The ``size`` most frequent answer tokens, sorted: draft id i is target id used[i]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens, answer in pieces:
        np.add.at(counts, tokens[answer], 1)
    return np.sort(np.argsort(-counts, kind="stable")[: min(size, vocab_size)])


def d2t_t2d(used: np.ndarray, vocab_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """EAGLE-3's maps: target_id = draft_id + d2t[draft_id]; t2d[target_id]: in the draft vocab."""
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[used] = True
    return (used - np.arange(len(used))).astype(np.int64), t2d


def make_batch(pieces: Sequence[Piece], rows: Optional[int] = None, length: Optional[int] = None
               ) -> Dict[str, mx.array]:
    """Pad to ``rows`` x ``length`` (default: just enough). Position t trains the prediction
    of token t + 2 from (feature t, token t + 1); it counts when that token is an answer's."""
    rows = rows or len(pieces)
    length = length or max(len(t) for t, _ in pieces)
    tokens = np.zeros((rows, length), dtype=np.int32)
    mask = np.zeros((rows, length), dtype=bool)
    for row, (ids, answer) in enumerate(pieces):
        tokens[row, :len(ids)] = ids
        mask[row, :max(len(ids) - 2, 0)] = answer[2:]
    return {"tokens": mx.array(tokens), "mask": mx.array(mask), "index": mx.array(np.flatnonzero(mask))}


def sharegpt_pieces(tokenizer, root: Path, seq_len: int, dialogues: Optional[int], held_out: int,
                    progress: bool) -> Tuple[List[Piece], List[str]]:
    """ShareGPT's dialogues with their own answers, every assistant turn in its context,
    tokenized once into ``root`` (resumed from there); the last ``held_out`` dialogues are
    kept out, their first prompts returned for measuring acceptance."""


    path = root / f"dialogues-{seq_len}-{dialogues or 'all'}-{held_out}.npz"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        every = list(sharegpt_dialogues())
        train, kept = every[: len(every) - held_out], every[len(every) - held_out:]
        pieces = [piece for dialogue in progress_bar(train[:dialogues], desc="tokenizing ShareGPT", unit="dialogue",
                                             disable=not progress)
                  for piece in dialogue_tokens(tokenizer, dialogue, seq_len)]
        save_dialogues(path, pieces, [dialogue[0]["content"] for dialogue in kept])
    return load_dialogues(path)


def self_distilled_pieces(model: nn.Module, tokenizer, root: Path, prompts: int, held_out: int,
                          max_answer_tokens: int, progress: bool) -> Tuple[List[Piece], List[str]]:
    """ShareGPT's first prompts answered by the target itself (greedy), resumably; more
    prompts than before extend the answers made before."""

    every = sharegpt_prompts(limit=prompts + held_out)
    data, marker = root / "data-self", root / "data-self" / "done"
    done = json.loads(marker.read_text()) if marker.exists() else {"prompts": 0, "shards": 0}
    if done["prompts"] and done["max_answer_tokens"] != max_answer_tokens:
        raise UserError(f"{data} holds answers of up to {done['max_answer_tokens']} tokens; pass "
                        f"--max-answer-tokens {done['max_answer_tokens']} or another --data")
    if done["prompts"] > prompts:
        raise UserError(f"{data} holds answers to {done['prompts']} prompts; pass --prompts {done['prompts']} "
                        "(--subset N trains on fewer) or another --data")
    if done["prompts"] < prompts:
        shards = self_distill(model, tokenizer, every[done["prompts"]:prompts], data, first_shard=done["shards"],
                              max_answer_tokens=max_answer_tokens, progress=progress)
        write_atomically(marker, json.dumps({"prompts": prompts, "shards": shards,
                                             "max_answer_tokens": max_answer_tokens}))
    pieces = [(tokens, np.arange(len(tokens)) >= prompt_length) for tokens, prompt_length in load_shards(data)]
    return pieces, every[prompts:]
