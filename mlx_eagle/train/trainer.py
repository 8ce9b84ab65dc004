"""The training loop of one run: the head, its optimizer, checkpoints swapped by renames
(a kill at any moment leaves a complete one, and a resumed run reaches the same weights)
and the log and curves."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from matplotlib.figure import Figure
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserError
from ..files import disk_error, replace_directory, retired, write_atomically
from ..progress import progress_bar
from ..target import layer_count
from .families import FAMILIES
from .pieces import Piece, make_batch
from .recipe import TrainConfig, epoch_batches, learning_rate, padded_length
from .store import StateStore
from .ttt import same_draft_vocabulary, target_states


def steps_within(make_trainer, config: TrainConfig, seconds: float, work: Path, probe_steps: int = 10) -> TrainConfig:
    """``config`` with as many steps as fit in ``seconds``: a probe trainer (in
    work/probe, from the same start) times ``probe_steps`` steps, the median of the later
    two thirds (after compiling) is taken with a 10% margin, and the warm-up scales along."""
    probe = make_trainer(config, work / "probe")
    times = []
    for _ in range(probe_steps):
        tic = time.perf_counter()
        probe.train_step()
        probe.step += 1
        times.append(time.perf_counter() - tic)
    shutil.rmtree(work / "probe", ignore_errors=True)
    step = float(np.median(times[len(times) // 3:]))
    steps = max(2, int((seconds - sum(times) - 45) / (1.1 * step)))
    print(f"a step takes {step:.2f} s here: {steps} steps fit in the time budget", flush=True)
    return replace(config, steps=steps, warmup=max(min(config.warmup, steps // 2), steps // 30))


class Trainer:
    """Owns the head, optimizer and checkpoints of one training run. The target's states
    are recomputed for every batch, or read from a ``store``: see README, "Training a head"."""

    def __init__(self, target: nn.Module, head: nn.Module, pieces: Sequence[Piece], config: TrainConfig,
                 work: Path, used: Optional[np.ndarray] = None, progress: bool = True,
                 store: Optional[StateStore] = None):
        self.target, self.head, self.pieces, self.config, self.work = target, head, pieces, config, work
        self.family = FAMILIES[config.family].code()
        self.store = store
        self.used = mx.array(used if used is not None else [0])
        self.lengths = [min(len(t), config.seq_len) for t, _ in pieces]
        self.taps = head.taps(layer_count(target))
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
        total, losses, accuracies = self.family.loss(head, self.target, tokens, mask, features, last, used, key,
                                                     self.config)
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
        config = self.config
        bar = progress_bar(total=config.steps, initial=self.step, unit="step", desc=f"training {config.family}",
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
                try:
                    log.write(json.dumps(entry) + "\n")
                    log.flush()
                except OSError as exc:
                    raise disk_error(exc, self.work / "log.jsonl") from None
            bar.update(1)
            bar.set_postfix(loss=f"{total:.3f}", acc="/".join(f"{a:.2f}" for a in accuracies))
            if self.step % config.checkpoint_every == 0 or self.step == config.steps:
                self.save_checkpoint()
        bar.close()
        if log is not None:
            log.close()

    def save_checkpoint(self) -> None:
        """Write the checkpoint beside the last one and swap them by renames (files.py), so
        that a kill at any moment leaves a complete checkpoint, and a full disk leaves the
        last one and one line."""
        if not self.main:
            return

        def fill(staging: Path) -> None:
            mx.save_safetensors(str(staging / "head.safetensors"), dict(tree_flatten(self.head.parameters())))
            mx.save_safetensors(str(staging / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
            (staging / "state.json").write_text(json.dumps({"step": self.step, "config": asdict(self.config)}))

        replace_directory(self.work / "checkpoint", fill, overwrite=True)

    def _resume(self) -> None:
        directory = self.work / "checkpoint"
        if not (directory / "state.json").exists():
            directory = retired(directory)  # killed between a save's two renames
            if not (directory / "state.json").exists():
                return
        state = json.loads((directory / "state.json").read_text())
        weights = mx.load(str(directory / "head.safetensors"))
        if not same_draft_vocabulary(self.head, weights.items()):
            raise UserError(f"the checkpoint in {self.work} was trained with another draft vocabulary than "
                            "this run's; pass a new --work")
        self.head.load_weights(list(weights.items()))
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
        try:
            write_atomically(log, "".join(line + "\n" for line in kept))
        except OSError as exc:
            raise disk_error(exc, log) from None


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):  # a line cut by a kill
        return 1 << 62


def plot_curves(log_path: Path, out: Path) -> None:
    """Loss and draft accuracy per unrolled step, over training."""
    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not entries:
        return
    steps = [e["step"] for e in entries]
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
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
