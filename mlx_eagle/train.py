"""Train an EAGLE draft head for any supported target, resumably.

    python -m mlx_eagle.train --out my-head [--model M] [--family eagle3] [--answers sharegpt]

Stages, each kept in --data / --work and skipped when already done, so a stopped run resumes:
  dialogues-*.npz  every assistant turn of ShareGPT's dialogues, as token ids with an answer
                   mask (--answers self: data-self/, first prompts answered by the target)
  vocab-*.npz      the draft vocabulary: the most frequent answer tokens (d2t, t2d)
  checkpoint/, log.jsonl, curves.png: training; the head is then written to --out.
The target's states (EAGLE-3 taps, post-norm last state) are recomputed for every batch,
or computed once into --store-features DIR and read from there (StateStore).
EAGLE-3 trains by training-time test: the head is unrolled --ttt-steps times on its own
outputs, each step seeing what it sees at inference (TTTCache), against the target's
probabilities; step k's loss is weighted by --step-decay ** k. Data parallel:
``mlx.launch -n 2 --backend ring .venv/bin/python -m mlx_eagle.train ...`` after one
``--prepare-only`` run (each process takes its share of every batch; gradients are averaged).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from functools import partial
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache

from .cli import add_model_arguments, run_cli
from .errors import UserError
from .features import self_distill
from .generate import chat_tokens
from .models import TARGET_FILE, target_identity
from .target import lm_head, lm_head_rows, target_forward

@dataclass
class TrainConfig:
    family: str = "eagle3"
    steps: int = 2000
    tokens_per_batch: int = 4096  # rows x padded length of one micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int = 1024
    lr: float = 5e-4
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 0.5
    ttt_steps: int = 5
    step_decay: float = 0.8
    checkpoint_every: int = 200
    seed: int = 0
    pad_multiple: int = 64  # batch lengths are rounded up to this, so compiled steps see few shapes
    compile: bool = True
    # Recipe levers (off by default; README's ablations):
    mask_outside_draft: bool = False  # positions whose target choice is outside the draft vocabulary do not count
    feature_noise: float = 0.0  # uniform noise in (-x, x) on the target's states, as EAGLE-1 trains
    train_embeddings: bool = False  # the head gets an embedding of its own (the target's to start), trained

    def __post_init__(self) -> None:
        """One line naming a setting no run could train with."""
        at_least = {"steps": 1, "tokens_per_batch": 1, "grad_accum": 1, "seq_len": 2, "warmup": 0, "ttt_steps": 1,
                    "checkpoint_every": 1, "seed": 0, "pad_multiple": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"{name.replace('_', '-')} must be a whole number, {low} or more, not {value!r}")
        for name in ("lr", "weight_decay", "clip", "step_decay", "feature_noise"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or \
                    (name == "lr" and value == 0):
                raise UserError(f"{name.replace('_', '-')} must be a finite number, 0 or more"
                                f"{' (above 0)' if name == 'lr' else ''}, not {value!r}")
        if self.mask_outside_draft and self.family != "eagle3":
            raise UserError("mask-outside-draft is for EAGLE-3 heads, which draft from a draft vocabulary")


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


def head_to_train(target, family: str, used: np.ndarray, seed: int = 0, train_embeddings: bool = False):
    """A new head for training, in float32 whatever the target's dtype (a bfloat16 or
    quantized target on a GPU would otherwise give a bfloat16 head to AdamW). An EAGLE-3
    head starts speaking the target's output language: its final norm and reduced LM head
    begin as the target's own (the draft vocabulary's rows of it), so training spends its
    steps on prediction rather than on relearning the vocabulary. ``train_embeddings``:
    the head gets an embedding of its own, a copy of the target's, which training moves."""
    from .heads import new_head

    head = new_head(target, family, draft_vocab_size=len(used), seed=seed)
    if train_embeddings:
        vocab = target.args.vocab_size
        head.embed_tokens = nn.Embedding(vocab, target.args.hidden_size)
        head.embed_tokens.weight = target.model.embed_tokens(mx.arange(vocab)).astype(mx.float32)
    head.set_dtype(mx.float32)
    if family == "eagle3":
        head.d2t = mx.array(d2t_t2d(used, target.args.vocab_size)[0])
        head.norm.weight = target.model.norm.weight.astype(mx.float32)
        head.lm_head.weight = lm_head_rows(target, mx.eye(target.args.hidden_size), mx.array(used)).T.astype(mx.float32)
    return head


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


def target_states(target, tokens: mx.array, taps: Optional[Sequence[int]]) -> Tuple[mx.array, mx.array]:
    """What a head trains on, computed afresh for each batch: the tapped states (EAGLE-3;
    the last state for EAGLE-1) and the post-norm last state, which gives the target's
    probabilities. The full-vocabulary logits are never evaluated, so never computed."""
    out = target_forward(target, tokens, [KVCache() for _ in target.model.layers], 0, "causal", taps)
    return mx.stop_gradient(out.features), mx.stop_gradient(out.hidden)


def shift(x: mx.array, by: int) -> mx.array:
    """Move along the sequence axis by ``by`` (>0: right), filling with zeros."""
    zeros = mx.zeros_like(x[:, :abs(by)])
    return mx.concatenate([zeros, x[:, :-by]], axis=1) if by > 0 else mx.concatenate([x[:, -by:], zeros], axis=1)


class TTTCache:
    """The head's keys and values across training-time-test steps, attending as a tree
    node of each depth does at inference without forming that mask: step k's query at
    position t sees step 0's keys up to t - k (the committed context) and, from each
    later step j, only the key at t - k + j (its own ancestor). It scores L + k keys
    where a dense [L, (k + 1) L] mask would score (k + 1) L, which at TTT 5 over 2,048
    tokens is most of the head's work. target.layer_block asks a cache with ``attend``
    for the attention."""

    def __init__(self):
        self.keys: List[mx.array] = []
        self.values: List[mx.array] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        self.keys.append(keys)
        self.values.append(values)
        return keys, values

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        step = len(self.keys) - 1
        if step == 0:
            return mx.fast.scaled_dot_product_attention(queries, self.keys[0], self.values[0], scale=scale,
                                                        mask="causal")
        batch, heads, length, width = queries.shape
        kv_heads = self.keys[0].shape[1]
        grouped = (queries * scale).reshape(batch, kv_heads, heads // kv_heads, length, width)
        t = mx.arange(length)
        context = grouped @ self.keys[0][:, :, None].swapaxes(-1, -2)  # [batch, kv, group, L, L]
        scores = [mx.where(t[None] <= t[:, None] - step, context, -mx.inf)]
        # Step j's key for the query at t sits at t - (step - j): moved right by step - j.
        ancestors = [(shift_positions(self.keys[j], step - j), shift_positions(self.values[j], step - j))
                     for j in range(1, step + 1)]
        for j, (keys, _) in enumerate(ancestors, start=1):
            score = (grouped * keys[:, :, None]).sum(-1, keepdims=True)
            scores.append(mx.where((t >= step - j)[:, None], score, -mx.inf))
        weights = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
        out = weights[..., :length] @ self.values[0][:, :, None]
        for j, (_, values) in enumerate(ancestors, start=1):
            out = out + weights[..., length + j - 1:length + j] * values[:, :, None]
        return out.reshape(batch, heads, length, width)


def shift_positions(x: mx.array, by: int) -> mx.array:
    """[batch, heads, length, width] moved ``by`` positions later, zeros first."""
    return mx.concatenate([mx.zeros_like(x[:, :, :by]), x[:, :, :x.shape[2] - by]], axis=2) if by else x


def ttt_unroll(head, target, tokens: mx.array, features: mx.array, steps: int) -> Iterator[Tuple[int, mx.array]]:
    """Training-time test: the head unrolled ``steps`` times on its own outputs. Yields
    (step, the head's logits [batch, length, draft vocab]). Step k at position t predicts
    token t + 2 as a depth-(k + 1) tree node does: true tokens up to t + 1, the target's
    features only up to t - k, the head's own outputs after that (see TTTCache)."""
    next_tokens = shift(tokens, -1)
    cache = [TTTCache()]
    hidden = head.project(features.astype(mx.float32))
    for step in range(steps):
        out = head.step(target, hidden, next_tokens, cache, 0, None)
        yield step, head.logits(target, out).astype(mx.float32)
        hidden = shift(out, 1)  # position t next reads the head's own output at t - 1


def eagle3_loss(head, target, tokens, mask, features, last, used: mx.array, ttt_steps: int, step_decay: float,
                mask_outside_draft: bool = False):
    """Training-time test; returns (loss, per-step losses, per-step accuracies). The target
    distribution at t is the target's next-token distribution at t + 1, renormalised over
    the draft vocabulary, as EAGLE-3 trains. ``mask_outside_draft``: positions where the
    target's own choice (over its whole vocabulary) is no draft token do not count, since
    no draft can be accepted there (this computes the full LM head once)."""
    target_logits = lm_head_rows(target, shift(last, -1).astype(mx.float32), used)
    wanted = mx.softmax(target_logits, axis=-1)
    target_choice = mx.argmax(target_logits, axis=-1)
    if mask_outside_draft:
        in_draft = mx.zeros((target.args.vocab_size,)).at[used].add(1.0) > 0
        mask = mask & in_draft[mx.argmax(lm_head(target, shift(last, -1)), axis=-1)]
    position = mx.arange(tokens.shape[1])[None]
    total, losses, accuracies = 0.0, [], []
    for step, logits in ttt_unroll(head, target, tokens, features, ttt_steps):
        logprobs = nn.log_softmax(logits, axis=-1)
        valid = mask & (position >= step)  # a step-k draft needs k tokens of context before it
        count = mx.maximum(valid.sum(), 1)
        loss = (-(wanted * logprobs).sum(-1) * valid).sum() / count
        accuracies.append(((mx.argmax(logits, axis=-1) == target_choice) & valid).sum() / count)
        losses.append(loss)
        total = total + (step_decay ** step) * loss
    return total, losses, accuracies


def eagle1_loss(head, target, tokens, mask, features, last):
    """EAGLE-1/2: regress the next feature (smooth L1) + 0.1 x token cross-entropy."""
    features = features.astype(mx.float32)
    out = head.step(target, features, shift(tokens, -1), [KVCache()], 0, "causal")
    count = mx.maximum(mask.sum(), 1)
    regression = (nn.losses.smooth_l1_loss(out, shift(features, -1), reduction="none").mean(-1) * mask).sum() / count
    target_logits = lm_head(target, shift(features, -1)).astype(mx.float32)
    logprobs = nn.log_softmax(lm_head(target, out).astype(mx.float32), axis=-1)
    cross_entropy = (-(mx.softmax(target_logits, axis=-1) * logprobs).sum(-1) * mask).sum() / count
    correct = mx.argmax(logprobs, axis=-1) == mx.argmax(target_logits, axis=-1)
    return regression + 0.1 * cross_entropy, [regression, cross_entropy], [(correct & mask).sum() / count]


def learning_rate(config: TrainConfig):
    warmup = max(1, min(config.warmup, config.steps - 1))
    return optim.join_schedules(
        [optim.linear_schedule(config.lr / warmup, config.lr, warmup),
         optim.cosine_decay(config.lr, max(1, config.steps - warmup), config.lr * 0.05)],
        [warmup],
    )


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def epoch_batches(lengths: Sequence[int], config: TrainConfig, epoch: int) -> List[List[int]]:
    """The micro-batches of one epoch, a pure function of (seed, epoch), so a resumed run
    sees exactly the batches an uninterrupted one would. The epoch is shuffled, then cut
    into windows whose pieces are sorted by length and packed by tokens: each micro-batch
    holds as many rows of its padded length as ``tokens_per_batch`` allows, so little of
    it is padding and a long piece does not make a batch larger."""
    rng = np.random.default_rng(config.seed + epoch)
    order = rng.permutation(len(lengths))
    batches = []
    window = max(64, 16 * config.tokens_per_batch // max(1, int(np.mean(lengths))))
    for start in range(0, len(order), window):
        part = sorted(order[start:start + window], key=lambda i: -lengths[i])
        while part:
            rows = max(1, config.tokens_per_batch // padded_length(lengths[part[0]], config.pad_multiple))
            batches.append([int(i) for i in part[:rows]])
            part = part[rows:]
    return [batches[i] for i in rng.permutation(len(batches))]


class StateStore:
    """The target's states for every piece (its taps, or the last state for EAGLE-1, and
    the post-norm last state), computed once in packed batches and kept on disk in
    float16: 4.6 KB a token for SmolLM2-135M with EAGLE-3 taps. Worth it when the same
    pieces are trained on many times (epochs, or many runs such as ablations) and fit on
    disk; the full ShareGPT set does not (see README), so by default states are recomputed.
    ``fill`` resumes where a killed run stopped; a store made from other pieces, another
    target or other taps is refused."""

    def __init__(self, path: Path, target: nn.Module, pieces: Sequence[Piece], taps: Optional[Sequence[int]],
                 seq_len: int):
        import hashlib

        self.path, self.target, self.taps = path, target, taps
        self.tokens = [np.asarray(t[:seq_len], dtype=np.int32) for t, _ in pieces]
        self.starts = np.concatenate([[0], np.cumsum([len(t) for t in self.tokens])])
        hidden = target.args.hidden_size
        self.widths = (hidden * (len(taps) if taps is not None else 1), hidden)
        digest = hashlib.sha256(json.dumps([target_identity(target), list(taps or []), self.widths]).encode())
        # The weights too (a fine-tune has the same identity): the final norm and a sample of the embedding.
        digest.update(np.array(mx.concatenate([target.model.norm.weight.astype(mx.float32),
                                               target.model.embed_tokens(mx.arange(64)).astype(mx.float32).reshape(-1)])
                               ).tobytes())
        for tokens in self.tokens:
            digest.update(len(tokens).to_bytes(4, "little") + tokens.tobytes())
        self.meta = {"fingerprint": digest.hexdigest(), "tokens": int(self.starts[-1]), "pieces": len(self.tokens),
                     "widths": list(self.widths)}
        path.mkdir(parents=True, exist_ok=True)
        meta_path = path / "meta.json"
        if meta_path.exists() and json.loads(meta_path.read_text()) != self.meta:
            raise UserError(f"{path} holds the states of other pieces, another target or other taps; pass another "
                            "--store-features directory")
        size = self.meta["tokens"] * sum(self.widths) * 2
        states = path / "states.f16"
        if not meta_path.exists() or not states.exists() or states.stat().st_size != size:  # a new store
            free = shutil.disk_usage(path).free + (states.stat().st_size if states.exists() else 0)
            if size > free:
                raise UserError(f"the target's states need {size / 1e9:.1f} GB and {path} has {free / 1e9:.1f} GB "
                                "free; train without --store-features (states are then recomputed) or on fewer "
                                "pieces (--prompts, --subset)")
            (path / "filled.json").unlink(missing_ok=True)
            with open(states, "wb") as file:
                file.truncate(size)  # sparse until filled
            meta_path.write_text(json.dumps(self.meta))
        self.states = np.memmap(states, dtype=np.float16, mode="r+", shape=(self.meta["tokens"], sum(self.widths)))

    def _filled(self) -> int:
        """How many pieces, in order of decreasing length, have their states on disk."""
        done = self.path / "filled.json"
        return json.loads(done.read_text())["pieces"] if done.exists() else 0

    def missing(self) -> bool:
        return self._filled() < len(self.tokens)

    def fill(self, tokens_per_batch: int, progress: bool = True) -> float:
        """Compute what is missing, longest pieces first, packed by tokens so that little is
        padding; returns the target's tokens/s (0.0 when nothing was missing)."""
        from tqdm import tqdm

        order = sorted(range(len(self.tokens)), key=lambda i: -len(self.tokens[i]))
        done = self._filled()
        bar = tqdm(total=self.meta["tokens"], initial=sum(len(self.tokens[i]) for i in order[:done]), unit="token",
                   desc="target states", disable=not progress)
        tic, computed = time.perf_counter(), 0
        while done < len(order):
            length = padded_length(len(self.tokens[order[done]]), 16)
            chosen = order[done:done + max(1, tokens_per_batch // length)]
            batch = make_batch([(self.tokens[i], np.ones(len(self.tokens[i]), bool)) for i in chosen], len(chosen),
                               length)
            states = np.array(mx.concatenate(target_states(self.target, batch["tokens"], self.taps), axis=-1)
                              .astype(mx.float32))
            if not np.isfinite(states).all() or np.abs(states).max() > np.finfo(np.float16).max:
                raise UserError("the target's states exceed float16's range; train without --store-features")
            for row, i in enumerate(chosen):
                self.states[self.starts[i]:self.starts[i + 1]] = states[row, :len(self.tokens[i])]
            self.states.flush()
            done += len(chosen)
            staging = self.path / "filled.partial"
            staging.write_text(json.dumps({"pieces": done}))
            staging.replace(self.path / "filled.json")  # only once the states it counts are on disk
            tokens = sum(len(self.tokens[i]) for i in chosen)
            computed += tokens
            bar.update(tokens)
        bar.close()
        return computed / (time.perf_counter() - tic) if computed else 0.0

    def batch(self, chosen: Sequence[int], rows: int, length: int) -> Tuple[mx.array, mx.array]:
        """(features, last) for ``chosen`` pieces padded to rows x length, in the target's dtype."""
        states = np.zeros((rows, length, sum(self.widths)), dtype=np.float16)
        for row, i in enumerate(chosen):
            states[row, :len(self.tokens[i])] = self.states[self.starts[i]:self.starts[i + 1]]
        states = mx.array(states).astype(self.target.model.norm.weight.dtype)
        return states[..., :self.widths[0]], states[..., self.widths[0]:]


class Trainer:
    """Owns the head, optimizer and checkpoints of one training run. The target's states
    are recomputed for every batch, or read from a ``store``: see README, "Training a head"."""

    def __init__(self, target: nn.Module, head: nn.Module, pieces: Sequence[Piece], config: TrainConfig,
                 work: Path, used: Optional[np.ndarray] = None, progress: bool = True,
                 store: Optional[StateStore] = None):
        self.target, self.head, self.pieces, self.config, self.work = target, head, pieces, config, work
        self.store = store
        self.used = mx.array(used if used is not None else [0])
        self.lengths = [min(len(t), config.seq_len) for t, _ in pieces]
        self.taps = head.taps(target.args.num_hidden_layers)
        self._epochs: Dict[int, List[List[int]]] = {}
        work.mkdir(parents=True, exist_ok=True)
        self.group = mx.distributed.init()
        self.main = self.group.rank() == 0
        self.progress = progress and self.main
        head.freeze(keys=["d2t"], strict=False)
        target.freeze()
        self.optimizer = optim.AdamW(learning_rate=learning_rate(config), weight_decay=config.weight_decay)
        self.optimizer.init(head.trainable_parameters())
        self.step = 0
        self._resume()
        state = [self.head.state, self.optimizer.state]
        # Compiled once per batch shape; lengths are padded to a multiple, so shapes repeat.
        compiled = partial(mx.compile, inputs=state + [self.target.state], outputs=state) if config.compile \
            else (lambda f: f)
        self._gradients, self._update = compiled(self._micro_batch), compiled(self._apply)

    def micro_batches(self, step: int) -> List[List[int]]:
        """The micro-batches of optimizer step ``step`` (this rank's rows of each)."""
        first = step * self.config.grad_accum
        chosen, epoch = [], 0
        while len(chosen) < self.config.grad_accum:
            if epoch not in self._epochs:
                self._epochs[epoch] = epoch_batches(self.lengths, self.config, epoch)
            batches = self._epochs[epoch]
            if first < len(batches):
                chosen += batches[first:first + self.config.grad_accum - len(chosen)]
                first = 0
            else:
                first -= len(batches)
            epoch += 1
        world, rank = self.group.size(), self.group.rank()
        return [batch[rank::world] for batch in chosen]

    def _loss(self, head, tokens, mask, used, key, *stored):
        features, last = stored or target_states(self.target, tokens, self.taps)
        if self.config.feature_noise:
            features = features + mx.random.uniform(-self.config.feature_noise, self.config.feature_noise,
                                                    features.shape, key=key).astype(features.dtype)
        if self.config.family == "eagle3":
            total, losses, accuracies = eagle3_loss(head, self.target, tokens, mask, features, last, used,
                                                    self.config.ttt_steps, self.config.step_decay,
                                                    self.config.mask_outside_draft)
        else:
            total, losses, accuracies = eagle1_loss(head, self.target, tokens, mask, features, last)
        return total, (losses, accuracies)

    def _micro_batch(self, tokens, mask, accumulated, used, key, *stored):
        # The draft vocabulary and the noise's key are arguments: mx.compile cannot capture arrays.
        (total, (losses, accuracies)), grads = nn.value_and_grad(self.head, self._loss)(self.head, tokens, mask, used,
                                                                                         key, *stored)
        # Flat {name: gradient}: compiled outputs drop the empty subtrees a module's gradient holds.
        return total, losses, accuracies, {k: accumulated[k] + g for k, g in tree_flatten(grads)}

    def _apply(self, accumulated):
        grads = tree_unflatten([(k, g / self.config.grad_accum) for k, g in accumulated.items()])
        if self.group.size() > 1:
            grads = nn.average_gradients(grads, group=self.group)
        grads, norm = optim.clip_grad_norm(grads, self.config.clip)
        self.optimizer.update(self.head, grads)
        return norm

    def train_step(self) -> Tuple[float, List[float], List[float], int]:
        """One optimizer step: (loss, per-step losses, per-step accuracies, answer tokens seen)."""
        grads = {k: mx.zeros_like(p) for k, p in tree_flatten(self.head.trainable_parameters())}
        totals, step_losses, step_accuracies, tokens = [], [], [], 0
        for micro, chosen in enumerate(self.micro_batches(self.step)):
            length = padded_length(max(self.lengths[i] for i in chosen), self.config.pad_multiple)
            rows = max(1, self.config.tokens_per_batch // length // self.group.size())
            batch = make_batch([self._piece(i) for i in chosen], rows, length)
            # A key per micro-batch of the run: a resumed run draws the same noise.
            key = mx.random.key((self.config.seed * 1_000_003 + self.step * self.config.grad_accum + micro)
                                * self.group.size() + self.group.rank())
            stored = self.store.batch(chosen, rows, length) if self.store else ()
            total, losses, accuracies, grads = self._gradients(batch["tokens"], batch["mask"], grads, self.used, key,
                                                               *stored)
            mx.async_eval(grads)  # the next batch is built while this one runs
            totals.append(total)
            step_losses.append(losses)
            step_accuracies.append(accuracies)
            tokens += int(batch["index"].size)
        norm = self._update(grads)
        mx.eval(self.head.parameters(), self.optimizer.state, norm, totals, step_losses, step_accuracies)
        mean = lambda rows: [float(np.mean([float(x) for x in column])) for column in zip(*rows)]  # noqa: E731
        return float(np.mean([float(t) for t in totals])), mean(step_losses), mean(step_accuracies), tokens

    def _piece(self, index: int) -> Piece:
        tokens, answer = self.pieces[index]
        return tokens[:self.config.seq_len], answer[:self.config.seq_len]

    def run(self, stop_after: Optional[int] = None) -> None:
        """Train to ``config.steps``, or only up to step ``stop_after``."""
        from tqdm import tqdm

        config = self.config
        bar = tqdm(total=config.steps, initial=self.step, unit="step", desc=f"training {config.family}",
                   disable=not self.progress)
        log = open(self.work / "log.jsonl", "a") if self.main else None
        tic, tokens = time.perf_counter(), 0
        while self.step < min(config.steps, stop_after or config.steps):
            total, losses, accuracies, seen = self.train_step()
            self.step += 1
            tokens += seen * self.group.size()
            if log is not None:
                entry = {"step": self.step, "loss": total, "step_losses": losses, "step_accuracy": accuracies,
                         "lr": float(self.optimizer.learning_rate), "tokens": tokens,
                         "tokens_per_s": tokens / (time.perf_counter() - tic)}
                log.write(json.dumps(entry) + "\n")
                log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{total:.3f}", acc="/".join(f"{a:.2f}" for a in accuracies))
            if self.step % config.checkpoint_every == 0 or self.step == config.steps:
                self.save_checkpoint()
        bar.close()
        if log is not None:
            log.close()

    def save_checkpoint(self) -> None:
        """Write the checkpoint beside the last one and swap them by renames, so that a
        kill at any moment leaves a complete checkpoint: ``checkpoint`` or, between the
        two renames, ``checkpoint.old``."""
        if not self.main:
            return
        directory, staging, old = (self.work / name for name in ("checkpoint", "checkpoint.partial", "checkpoint.old"))
        shutil.rmtree(staging, ignore_errors=True)  # a save that was killed
        staging.mkdir(parents=True)
        mx.save_safetensors(str(staging / "head.safetensors"), dict(tree_flatten(self.head.parameters())))
        mx.save_safetensors(str(staging / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        (staging / "state.json").write_text(json.dumps({"step": self.step, "config": asdict(self.config)}))
        if (directory / "state.json").exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.replace(old)
        staging.replace(directory)
        shutil.rmtree(old, ignore_errors=True)

    def _resume(self) -> None:
        directory = self.work / "checkpoint"
        if not (directory / "state.json").exists():
            directory = self.work / "checkpoint.old"  # killed between a save's two renames
            if not (directory / "state.json").exists():
                return
        state = json.loads((directory / "state.json").read_text())
        self.head.load_weights(str(directory / "head.safetensors"))
        self.optimizer.state.update(tree_unflatten(list(mx.load(str(directory / "optimizer.safetensors")).items())))
        self.step = state["step"]
        mx.eval(self.head.parameters(), self.optimizer.state)
        self._truncate_log()

    def _truncate_log(self) -> None:
        """Drop log entries past the resumed step: they are trained again, and the curves
        would show them twice."""
        log = self.work / "log.jsonl"
        if not self.main or not log.exists():
            return
        kept = [line for line in log.read_text().splitlines() if line.strip() and _logged_step(line) <= self.step]
        staging = log.with_name("log.jsonl.partial")
        staging.write_text("".join(line + "\n" for line in kept))
        staging.replace(log)


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):  # a line cut by a kill
        return 1 << 62


def plot_curves(log_path: Path, out: Path) -> None:
    """Loss and draft accuracy per unrolled step, over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not entries:
        return
    steps = [e["step"] for e in entries]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [e["loss"] for e in entries], label="total")
    for k in range(len(entries[0]["step_losses"])):
        left.plot(steps, [e["step_losses"][k] for e in entries], alpha=0.6, label=f"step {k}")
    left.set(xlabel="training step", ylabel="loss", title="loss")
    left.legend()
    for k in range(len(entries[0]["step_accuracy"])):
        right.plot(steps, [e["step_accuracy"][k] for e in entries], label=f"step {k}")
    right.set(xlabel="training step", ylabel="top-1 agreement with the target", title="draft accuracy", ylim=(0, 1))
    right.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def acceptance_by_depth(target, tokenizer, head, prompts: Sequence[str], depth: int = 6,
                        max_tokens: int = 128) -> Dict[str, object]:
    """Greedy decoding with a chain of ``depth`` on held-out prompts: how often the
    draft token at each depth is accepted once all before it were, and tau."""
    from .decoder import SpeculativeDecoder
    from .drafters.eagle import EagleDrafter
    from .trees import parse_tree
    from .verify import Sampling

    reached, accepted, produced, rounds = np.zeros(depth), np.zeros(depth), 0, 0
    for prompt in prompts:
        ids = chat_tokens(tokenizer, [{"role": "user", "content": prompt}])
        decoder = SpeculativeDecoder(target, EagleDrafter(head, target, parse_tree(f"chain:{depth}")), Sampling())
        decoder.prefill(ids)
        generated = 1
        while generated < max_tokens:
            result = decoder.round(max_tokens - generated)
            taken = len(result.tokens) - 1
            reached[: min(taken + 1, result.drafted)] += 1
            accepted[:taken] += 1
            produced, rounds, generated = produced + len(result.tokens), rounds + 1, generated + len(result.tokens)
            if result.tokens[-1] in tokenizer.eos_token_ids or any(t in tokenizer.eos_token_ids for t in result.tokens):
                break
    rates = [float(a / r) if r else 0.0 for a, r in zip(accepted, reached)]
    return {"tau": produced / max(rounds, 1), "acceptance_by_depth": rates, "rounds": rounds}


def sharegpt_pieces(tokenizer, root: Path, seq_len: int, dialogues: Optional[int], held_out: int,
                    progress: bool) -> Tuple[List[Piece], List[str]]:
    """ShareGPT's dialogues with their own answers, every assistant turn in its context,
    tokenized once into ``root`` (resumed from there); the last ``held_out`` dialogues are
    kept out, their first prompts returned for measuring acceptance."""
    from tqdm import tqdm

    from .data import dialogue_tokens, load_dialogues, save_dialogues, sharegpt_dialogues

    path = root / f"dialogues-{seq_len}-{dialogues or 'all'}-{held_out}.npz"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        every = list(sharegpt_dialogues())
        train, kept = every[: len(every) - held_out], every[len(every) - held_out:]
        pieces = [piece for dialogue in tqdm(train[:dialogues], desc="tokenizing ShareGPT", unit="dialogue",
                                             disable=not progress)
                  for piece in dialogue_tokens(tokenizer, dialogue, seq_len)]
        save_dialogues(path, pieces, [dialogue[0]["content"] for dialogue in kept])
    return load_dialogues(path)


def self_distilled_pieces(model: nn.Module, tokenizer, root: Path, prompts: int, held_out: int,
                          max_answer_tokens: int, progress: bool) -> Tuple[List[Piece], List[str]]:
    """ShareGPT's first prompts answered by the target itself (greedy), resumably; more
    prompts than before extend the answers made before."""
    from .data import load_shards, sharegpt_prompts

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
        marker.write_text(json.dumps({"prompts": prompts, "shards": shards, "max_answer_tokens": max_answer_tokens}))
    pieces = [(tokens, np.arange(len(tokens)) >= prompt_length) for tokens, prompt_length in load_shards(data)]
    return pieces, every[prompts:]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlx_eagle.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the head directory to write")
    add_model_arguments(parser, draft=False, tree=False)
    parser.add_argument("--work", type=Path, help="checkpoints, log and curves (default: OUT.work)")
    parser.add_argument("--data", type=Path, help="tokenized data and vocabularies, shareable between runs "
                        "(default: --work)")
    parser.add_argument("--family", choices=["eagle3", "eagle1"], default="eagle3")
    parser.add_argument("--answers", choices=["sharegpt", "self"], default="sharegpt",
                        help="ShareGPT's own answers, every turn of every dialogue (default), or first prompts "
                        "answered by the target itself (self-distillation)")
    parser.add_argument("--prompts", type=int, help="dialogues (sharegpt; default all) or prompts (self; "
                        "default 2000) to train on")
    parser.add_argument("--held-out", type=int, default=20, help="further prompts kept for measuring acceptance")
    parser.add_argument("--max-answer-tokens", type=int, default=256, help="self-distilled answers' length")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocabulary size")
    defaults = TrainConfig()
    for name in ("steps", "tokens_per_batch", "grad_accum", "seq_len", "warmup", "ttt_steps", "checkpoint_every",
                 "seed", "pad_multiple"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("lr", "weight_decay", "clip", "step_decay", "feature_noise"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--mask-outside-draft", action="store_true", help="positions whose target choice is "
                        "no draft token do not count in the loss")
    parser.add_argument("--train-embeddings", action="store_true", help="train an embedding of the head's own "
                        "(a copy of the target's to start) instead of reading the target's")
    parser.add_argument("--mix-self", type=int, metavar="N", help="with --answers sharegpt: also train on N "
                        "ShareGPT first prompts answered by the target itself (self-distilled, made as --answers "
                        "self makes them; prompts over 256 tokens are skipped)")
    parser.add_argument("--subset", type=int, help="train on this many of the pieces, chosen at random "
                        "(for measuring what more data buys)")
    parser.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                        help="weights of the written head (training runs in float32)")
    parser.add_argument("--store-features", type=Path, metavar="DIR", help="compute the target's states once "
                        "and keep them in DIR (float16, ~4.6 KB a token for SmolLM2), shareable between runs on the "
                        "same pieces, instead of recomputing them for every batch")
    parser.add_argument("--prepare-only", action="store_true", help="stop after the data and vocabulary "
                        "(and the stored states, with --store-features)")
    parser.add_argument("--skip-eval", action="store_true", help="write the head without measuring acceptance")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the training step "
                        "uncompiled (mx.compile traces each new batch shape once)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    from .heads import load_head, save_head
    from .models import load

    # What is wrong with the arguments is said before the model loads.
    config = TrainConfig(family=args.family, **{k: getattr(args, k) for k in asdict(defaults) if k != "family"})
    for name, value, low in (("draft-vocab", args.draft_vocab, 1), ("held-out", args.held_out, 0),
                             ("prompts", args.prompts, 1), ("subset", args.subset, 1), ("mix-self", args.mix_self, 1),
                             ("max-answer-tokens", args.max_answer_tokens, 1)):
        if value is not None and value < low:
            raise UserError(f"--{name} must be {low} or more, not {value}")
    if args.mix_self and args.answers != "sharegpt":
        raise UserError("--mix-self adds the target's own answers to ShareGPT's; it needs --answers sharegpt")
    work = args.work or args.out.with_name(args.out.name + ".work")
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot use {work} for checkpoints and logs ({exc.strerror}); pass another --work") from None
    if args.store_features:
        try:
            args.store_features.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot keep the target's states in {args.store_features} ({exc.strerror}); pass "
                            "another --store-features") from None
    progress = not args.quiet
    world = mx.distributed.init()
    model, tokenizer = load(args.model)

    root = args.data or work
    if world.size() > 1 and not list(root.glob("vocab-*.npz")):
        raise UserError(f"prepare the data once without mlx.launch first: {parser.prog} ... --prepare-only")
    if args.answers == "sharegpt":
        pieces, held_out = sharegpt_pieces(tokenizer, root, config.seq_len, args.prompts, args.held_out, progress)
        vocab_path = root / f"vocab-sharegpt-{args.prompts or 'all'}-{args.draft_vocab}.npz"
    else:
        pieces, held_out = self_distilled_pieces(model, tokenizer, root, args.prompts or 2000, args.held_out,
                                                 args.max_answer_tokens, progress)
        vocab_path = root / f"vocab-self-{args.draft_vocab}.npz"
    if not vocab_path.exists():
        used = draft_vocabulary(pieces, model.args.vocab_size, args.draft_vocab)
        d2t, t2d = d2t_t2d(used, model.args.vocab_size)
        np.savez(vocab_path, used=used, d2t=d2t, t2d=t2d)
    if args.subset:
        chosen = np.random.default_rng(config.seed).permutation(len(pieces))[: args.subset]
        pieces = [pieces[i] for i in sorted(chosen)]
    if args.mix_self:  # after --subset, so that --subset N --mix-self M trains on N + M pieces
        pieces = pieces + self_distilled_pieces(model, tokenizer, root, args.mix_self, 0, args.max_answer_tokens,
                                                progress)[0]
    vocab = np.load(vocab_path)
    head = head_to_train(model, config.family, vocab["used"], config.seed, config.train_embeddings)
    store = None
    if args.store_features:
        store = StateStore(args.store_features, model, pieces, head.taps(model.args.num_hidden_layers),
                           config.seq_len)
        if world.size() > 1 and store.missing():
            raise UserError(f"fill {args.store_features} once without mlx.launch first: {parser.prog} ... "
                            "--store-features DIR --prepare-only")
        speed = store.fill(config.tokens_per_batch, progress)
        if speed:
            print(f"target states: {store.meta['tokens']:,} tokens in {args.store_features}, {speed:.0f} tokens/s")
    if args.prepare_only:
        return
    trainer = Trainer(model, head, pieces, config, work, used=vocab["used"], progress=progress, store=store)
    if config.family == "eagle3" and not np.array_equal(np.array(head.d2t), vocab["d2t"]):
        raise UserError(f"the checkpoint in {work} was trained with another draft vocabulary than {vocab_path}; "
                        "pass a new --work")
    trainer.run()
    if world.rank() != 0:
        return
    save_head(head, args.out, dtype=getattr(mx, args.save_dtype))
    # Whom it drafts for, so that shipped in mlx_eagle/weights/ it is found by --draft auto.
    (args.out / TARGET_FILE).write_text(json.dumps(target_identity(model), indent=1) + "\n")
    plot_curves(work / "log.jsonl", work / "curves.png")
    if args.skip_eval:
        return
    # Measured on the head as written (saved dtype), as users will load it.
    result = acceptance_by_depth(model, tokenizer, load_head(args.out, model), held_out)
    result.update(answers=args.answers, steps=config.steps,
                  tokens=int(sum(int(answer[:config.seq_len].sum()) for _, answer in pieces)))
    (work / "eval.json").write_text(json.dumps(result, indent=2))
    # Acceptance by (depth, rank), beside the head: --tree auto builds its tree from it on any device.
    from .calibrate import save_acceptance
    from .tune import calibration_pieces, measure_acceptance

    table = measure_acceptance(model, head, calibration_pieces(model, tokenizer, held_out, 128))
    save_acceptance(args.out, table, f"python -m mlx_eagle.train, {len(held_out)} held-out ShareGPT prompts")
    print(f"wrote {args.out}; held-out tau {result['tau']:.2f}, acceptance by depth "
          + " ".join(f"{r:.2f}" for r in result["acceptance_by_depth"]))


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
