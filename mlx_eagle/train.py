"""Train an EAGLE draft head for any supported target, resumably.

    python -m mlx_eagle.train --out my-head [--model M] [--family eagle3] [--prompts 2000]

Stages, each kept in --work and skipped when already done, so a stopped run resumes:
  data/      ShareGPT prompts answered by the target itself (greedy), as token ids
  features/  the target's states for every token (float16): the EAGLE-3 taps and the
             post-norm last state (which gives the target's probabilities, and is the
             EAGLE-1 feature)
  vocab.npz  the draft vocabulary: the most frequent answer tokens (d2t, t2d)
  checkpoint/, log.jsonl, curves.png: training; the head is then written to --out.
EAGLE-3 trains by training-time test: the head is unrolled --ttt-steps times on its own
outputs, each step under the attention mask it meets at inference, against the target's
probabilities; step k's loss is weighted by --step-decay ** k. Data parallel:
``mlx.launch -n 2 --backend ring .venv/bin/python -m mlx_eagle.train ...`` after one
``--prepare-only`` run (each process takes its share of every batch; gradients are averaged).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache

from .cli import UserError, run_cli
from .features import Sequences, compute_features, load_features, self_distill
from .target import lm_head, lm_head_rows

@dataclass
class TrainConfig:
    family: str = "eagle3"
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 5e-4
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 0.5
    ttt_steps: int = 5
    step_decay: float = 0.8
    checkpoint_every: int = 200
    seed: int = 0


def draft_vocabulary(sequences: Sequences, vocab_size: int, size: int) -> np.ndarray:
    """The ``size`` most frequent answer tokens, sorted: draft id i is target id used[i]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens, prompt_length in sequences:
        np.add.at(counts, tokens[prompt_length:], 1)
    return np.sort(np.argsort(-counts, kind="stable")[: min(size, vocab_size)])


def d2t_t2d(used: np.ndarray, vocab_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """EAGLE-3's maps: target_id = draft_id + d2t[draft_id]; t2d[target_id]: in the draft vocab."""
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[used] = True
    return (used - np.arange(len(used))).astype(np.int64), t2d


def init_from_target(head, target, used: np.ndarray) -> None:
    """Start an EAGLE-3 head speaking the target's output language: its final norm and
    reduced LM head begin as the target's own (the draft vocabulary's rows of it), so
    training spends its steps on prediction rather than on relearning the vocabulary."""
    head.norm.weight = target.model.norm.weight.astype(head.norm.weight.dtype)
    rows = lm_head_rows(target, mx.eye(target.args.hidden_size), mx.array(used)).T
    head.lm_head.weight = rows.astype(head.lm_head.weight.dtype)


def make_batch(records: Sequence[Dict[str, np.ndarray]]) -> Dict[str, mx.array]:
    """Pad to a common length. Position t trains the prediction of token t + 2 from
    (feature t, token t + 1); it counts when that token belongs to the answer."""
    length = max(len(r["tokens"]) for r in records)

    def pad(array, width):
        out = np.zeros((length, *array.shape[1:]), dtype=array.dtype)
        out[: len(array)] = array
        return out

    tokens = np.stack([pad(r["tokens"], length) for r in records])
    positions = np.arange(length)[None]
    lengths = np.array([len(r["tokens"]) for r in records])[:, None]
    prompt = np.array([r["prompt_length"] for r in records])[:, None]
    mask = (positions + 2 < lengths) & (positions + 2 >= prompt)
    return {
        "tokens": mx.array(tokens),
        "next_tokens": mx.array(np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)),
        "taps": mx.array(np.stack([pad(r["taps"], length) for r in records])),
        "last": mx.array(np.stack([pad(r["last"], length) for r in records])),
        "mask": mx.array(mask),
        "index": mx.array(np.flatnonzero(mask)),
    }


def ttt_mask(length: int, step: int) -> mx.array:
    """Attention mask of unrolled step ``step`` over the keys of steps 0..step: position t
    sees step 0 up to t - step (the committed context) and, from each later step j, only
    its own ancestor at t - step + j, as a depth-``step`` tree node does at inference."""
    t = mx.arange(length)[:, None]
    s = mx.arange(length)[None]
    blocks = [s <= t - step] + [s == t - step + j for j in range(1, step + 1)]
    return mx.concatenate(blocks, axis=1)


def shift(x: mx.array, by: int) -> mx.array:
    """Move along the sequence axis by ``by`` (>0: right), filling with zeros."""
    zeros = mx.zeros_like(x[:, :abs(by)])
    return mx.concatenate([zeros, x[:, :-by]], axis=1) if by > 0 else mx.concatenate([x[:, -by:], zeros], axis=1)


def counted(x: mx.array, batch: Dict[str, mx.array]) -> mx.array:
    """The rows of ``x`` [batch, length, ...] at the positions that count, flattened."""
    return x.reshape(-1, x.shape[-1])[batch["index"]]


def ttt_unroll(head, target, batch: Dict[str, mx.array], steps: int) -> Iterator[Tuple[int, mx.array]]:
    """Training-time test: the head unrolled ``steps`` times on its own outputs. Yields
    (step, the head's logits at the positions that count). Step k at position t predicts
    token t + 2 as a depth-(k + 1) tree node does: true tokens up to t + 1, the target's
    features only up to t - k, the head's own outputs after that."""
    length = batch["tokens"].shape[1]
    cache = [KVCache()]
    features = batch["taps"] if head.family == "eagle3" else batch["last"]
    hidden = head.project(features.astype(mx.float32))
    for step in range(steps):
        mask = "causal" if step == 0 else ttt_mask(length, step)
        out = head.step(target, hidden, batch["next_tokens"], cache, 0, mask)
        # Only the positions that count go through the LM head, a step's costliest part.
        yield step, head.logits(target, counted(out, batch)).astype(mx.float32)
        hidden = shift(out, 1)  # position t next reads the head's own output at t - 1


def draft_vocabulary_logits(target, batch: Dict[str, mx.array], used: mx.array) -> mx.array:
    """EAGLE-3's target: the target's logits at t + 1 restricted to the draft vocabulary."""
    return lm_head_rows(target, counted(shift(batch["last"], -1), batch).astype(mx.float32), used)


def eagle3_loss(head, target, batch, used: mx.array, ttt_steps: int, step_decay: float):
    """Training-time test; returns (loss, per-step losses, per-step accuracies). The target
    distribution is renormalised over the draft vocabulary, as EAGLE-3 trains."""
    target_logits = draft_vocabulary_logits(target, batch, used)
    wanted = mx.softmax(target_logits, axis=-1)
    target_choice = mx.argmax(target_logits, axis=-1)
    position = batch["index"] % batch["tokens"].shape[1]
    total, losses, accuracies = 0.0, [], []
    for step, logits in ttt_unroll(head, target, batch, ttt_steps):
        logprobs = nn.log_softmax(logits, axis=-1)
        valid = position >= step  # a step-k draft needs k tokens of context before it
        count = mx.maximum(valid.sum(), 1)
        loss = (-(wanted * logprobs).sum(-1) * valid).sum() / count
        accuracies.append(((mx.argmax(logprobs, axis=-1) == target_choice) & valid).sum() / count)
        losses.append(loss)
        total = total + (step_decay ** step) * loss
    return total, losses, accuracies


def eagle1_loss(head, target, batch):
    """EAGLE-1/2: regress the next feature (smooth L1) + 0.1 x token cross-entropy."""
    features = batch["last"].astype(mx.float32)
    out = head.step(target, features, batch["next_tokens"], [KVCache()], 0, "causal")
    valid = batch["mask"]
    count = mx.maximum(valid.sum(), 1)
    regression = (nn.losses.smooth_l1_loss(out, shift(features, -1), reduction="none").mean(-1) * valid).sum() / count
    target_logits = lm_head(target, shift(features, -1)).astype(mx.float32)
    logprobs = nn.log_softmax(lm_head(target, out).astype(mx.float32), axis=-1)
    cross_entropy = (-(mx.softmax(target_logits, axis=-1) * logprobs).sum(-1) * valid).sum() / count
    correct = mx.argmax(logprobs, axis=-1) == mx.argmax(target_logits, axis=-1)
    return regression + 0.1 * cross_entropy, [regression, cross_entropy], [(correct & valid).sum() / count]


def learning_rate(config: TrainConfig):
    warmup = max(1, min(config.warmup, config.steps - 1))
    return optim.join_schedules(
        [optim.linear_schedule(config.lr / warmup, config.lr, warmup),
         optim.cosine_decay(config.lr, max(1, config.steps - warmup), config.lr * 0.05)],
        [warmup],
    )


def batch_order(lengths: Sequence[int], config: TrainConfig, step: int, world: int = 1, rank: int = 0) -> List[int]:
    """The sequences of global step ``step``: a pure function of (seed, step), so a resumed
    run sees exactly the batches an uninterrupted one would; each rank takes its share.
    Each epoch is shuffled, then cut into windows of 32 batches whose sequences are
    grouped by length, so little of a batch is padding."""
    size = config.batch_size
    per_epoch = max(1, len(lengths) // size)
    epoch, within = divmod(step, per_epoch)
    rng = np.random.default_rng(config.seed + epoch)
    order = rng.permutation(len(lengths))[: per_epoch * size]
    window = 32 * size
    for start in range(0, len(order), window):
        part = order[start:start + window]
        order[start:start + window] = part[np.argsort([lengths[i] for i in part], kind="stable")]
    batches = order[: per_epoch * size].reshape(per_epoch, -1)[rng.permutation(per_epoch)]
    return [int(i) for i in batches[within][rank::world]]


class Trainer:
    """Owns the head, optimizer and checkpoints of one training run."""

    def __init__(self, target: nn.Module, head: nn.Module, records, config: TrainConfig, work: Path,
                 used: Optional[np.ndarray] = None, progress: bool = True):
        self.target, self.head, self.records, self.config, self.work = target, head, records, config, work
        self.used = mx.array(used) if used is not None else None
        self.lengths = [len(r["tokens"]) for r in records]
        work.mkdir(parents=True, exist_ok=True)
        self.group = mx.distributed.init()
        self.main = self.group.rank() == 0
        self.progress = progress and self.main
        head.freeze(keys=["d2t"], strict=False)
        target.freeze()
        self.optimizer = optim.AdamW(learning_rate=learning_rate(config), weight_decay=config.weight_decay)
        self.step = 0
        self._resume()

    def loss(self, head, batch):
        if self.config.family == "eagle3":
            return eagle3_loss(head, self.target, batch, self.used, self.config.ttt_steps, self.config.step_decay)
        return eagle1_loss(head, self.target, batch)

    def _train_step(self, batch):
        def objective(head):
            total, losses, accuracies = self.loss(head, batch)
            return total, (losses, accuracies)

        (total, (losses, accuracies)), grads = nn.value_and_grad(self.head, objective)(self.head)
        if self.group.size() > 1:
            grads = nn.average_gradients(grads, group=self.group)
        grads, norm = optim.clip_grad_norm(grads, self.config.clip)
        self.optimizer.update(self.head, grads)
        mx.eval(self.head.parameters(), self.optimizer.state, total, losses, accuracies)
        return float(total), [float(x) for x in losses], [float(x) for x in accuracies]

    def run(self, stop_after: Optional[int] = None) -> None:
        """Train to ``config.steps``, or only up to step ``stop_after``."""
        from tqdm import tqdm

        config = self.config
        bar = tqdm(total=config.steps, initial=self.step, unit="step", desc=f"training {config.family}",
                   disable=not self.progress)
        log = open(self.work / "log.jsonl", "a") if self.main else None
        tic, tokens = time.perf_counter(), 0
        while self.step < min(config.steps, stop_after or config.steps):
            chosen = batch_order(self.lengths, config, self.step, self.group.size(), self.group.rank())
            batch = make_batch([self.records[i] for i in chosen])
            total, losses, accuracies = self._train_step(batch)
            self.step += 1
            tokens += int(batch["mask"].sum().item())
            if log is not None:
                entry = {"step": self.step, "loss": total, "step_losses": losses, "step_accuracy": accuracies,
                         "lr": float(self.optimizer.learning_rate), "tokens_per_s": tokens / (time.perf_counter() - tic)}
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
        if not self.main:
            return
        directory = self.work / "checkpoint"
        partial = self.work / "checkpoint.partial"
        partial.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(partial / "head.safetensors"), dict(tree_flatten(self.head.parameters())))
        mx.save_safetensors(str(partial / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        (partial / "state.json").write_text(json.dumps({"step": self.step, "config": asdict(self.config)}))
        if directory.exists():
            import shutil

            shutil.rmtree(directory)
        partial.replace(directory)

    def _resume(self) -> None:
        directory = self.work / "checkpoint"
        if not (directory / "state.json").exists():
            return
        state = json.loads((directory / "state.json").read_text())
        self.head.load_weights(str(directory / "head.safetensors"))
        self.optimizer.state = tree_unflatten(list(mx.load(str(directory / "optimizer.safetensors")).items()))
        self.step = state["step"]
        mx.eval(self.head.parameters(), self.optimizer.state)


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
    from .trees import parse_tree
    from .verify import Sampling

    reached, accepted, produced, rounds = np.zeros(depth), np.zeros(depth), 0, 0
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        decoder = SpeculativeDecoder(target, head, parse_tree(f"chain:{depth}"), Sampling())
        decoder.prefill(ids)
        generated = 1
        while generated < max_tokens:
            result = decoder.step(max_tokens - generated)
            taken = len(result.tokens) - 1
            reached[: min(taken + 1, result.drafted)] += 1
            accepted[:taken] += 1
            produced, rounds, generated = produced + len(result.tokens), rounds + 1, generated + len(result.tokens)
            if result.tokens[-1] in tokenizer.eos_token_ids or any(t in tokenizer.eos_token_ids for t in result.tokens):
                break
    rates = [float(a / r) if r else 0.0 for a, r in zip(accepted, reached)]
    return {"tau": produced / max(rounds, 1), "acceptance_by_depth": rates, "rounds": rounds}


def prepared(root: Path, args: argparse.Namespace) -> Dict[str, int]:
    """What the answers and features under ``root`` were made from: prompts and shards (0: none)."""
    marker = root / f"features-{args.answers}" / "done"
    if not marker.exists():
        return {"prompts": 0, "shards": 0}
    done = json.loads(marker.read_text())
    if done["max_answer_tokens"] != args.max_answer_tokens:
        raise UserError(f"{root} holds answers of up to {done['max_answer_tokens']} tokens; pass "
                        f"--max-answer-tokens {done['max_answer_tokens']} or another --data")
    return done


def prepare_data(model: nn.Module, tokenizer, prompts: Sequence[str], root: Path, args: argparse.Namespace,
                 progress: bool) -> None:
    """Answers and features for ``prompts`` under ``root``. Data made before from fewer
    prompts is extended with the rest; its draft vocabulary is kept, so heads trained on
    it still resume (delete vocab-*.npz to count the tokens again)."""
    from .data import load_shards, original_answers, sharegpt_pairs
    from .heads import new_head

    data, features = root / f"data-{args.answers}", root / f"features-{args.answers}"
    before = prepared(root, args)
    done = before["prompts"]
    if done > len(prompts):
        raise UserError(f"{root} holds answers to {done} prompts; pass --prompts {done} "
                        "(--subset N trains on fewer) or another --data")
    if done == len(prompts):
        return
    taps = new_head(model, "eagle3").taps(model.args.num_hidden_layers)
    if args.answers == "self":
        shards = self_distill(model, tokenizer, prompts[done:], data, features, taps, first_shard=before["shards"],
                              max_answer_tokens=args.max_answer_tokens, progress=progress)
    elif done:
        raise UserError(f"{data} holds ShareGPT answers to {done} prompts and cannot be extended; "
                        f"pass --prompts {done} or another --data")
    else:
        original_answers(tokenizer, sharegpt_pairs(list(prompts)), data, max_answer_tokens=args.max_answer_tokens)
        compute_features(model, load_shards(data), features, taps, args.seq_len, progress=progress)
        shards = len(list(features.glob("features-?????.npz")))
    (features / "done").write_text(json.dumps({"prompts": len(prompts), "shards": shards,
                                               "max_answer_tokens": args.max_answer_tokens}) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlx_eagle.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the head directory to write")
    parser.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--work", type=Path, help="checkpoints, log and curves (default: OUT.work)")
    parser.add_argument("--data", type=Path, help="answers, features and vocabularies, shareable between runs "
                        "(default: --work)")
    parser.add_argument("--family", choices=["eagle3", "eagle1"], default="eagle3")
    parser.add_argument("--prompts", type=int, default=2000, help="ShareGPT prompts to train on")
    parser.add_argument("--held-out", type=int, default=20, help="further prompts kept for measuring acceptance")
    parser.add_argument("--answers", choices=["self", "sharegpt"], default="self",
                        help="answers regenerated by the target (self-distillation) or ShareGPT's own")
    parser.add_argument("--max-answer-tokens", type=int, default=256)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocabulary size")
    defaults = TrainConfig()
    for name in ("steps", "batch_size", "seq_len", "warmup", "ttt_steps", "checkpoint_every", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("lr", "weight_decay", "clip", "step_decay"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--subset", type=int, help="train on this many of the sequences, chosen at random "
                        "(for measuring what more data buys)")
    parser.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                        help="weights of the written head (training runs in float32)")
    parser.add_argument("--prepare-only", action="store_true", help="stop after data, vocabulary and features")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    from .data import load_shards, sharegpt_prompts
    from .heads import load_head, new_head, save_head
    from .models import load

    config = TrainConfig(family=args.family, **{k: getattr(args, k) for k in asdict(defaults) if k != "family"})
    work = args.work or args.out.with_name(args.out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    progress = not args.quiet
    world = mx.distributed.init()
    model, tokenizer = load(args.model)

    prompts = sharegpt_prompts(limit=args.prompts + args.held_out)
    train_prompts, held_out = prompts[: args.prompts], prompts[args.prompts:]
    root = args.data or work
    vocab_path = root / f"vocab-{args.answers}-{args.draft_vocab}.npz"
    if world.size() > 1 and not (vocab_path.exists() and prepared(root, args)["prompts"] == len(train_prompts)):
        raise UserError(f"prepare the data once without mlx.launch first: {parser.prog} ... --prepare-only")
    prepare_data(model, tokenizer, train_prompts, root, args, progress)
    if not vocab_path.exists():
        used = draft_vocabulary(load_shards(root / f"data-{args.answers}"), model.args.vocab_size, args.draft_vocab)
        d2t, t2d = d2t_t2d(used, model.args.vocab_size)
        np.savez(vocab_path, used=used, d2t=d2t, t2d=t2d)
    if args.prepare_only:
        return

    vocab = np.load(vocab_path)
    records = load_features(root / f"features-{args.answers}", config.seq_len)
    if args.subset:
        chosen = np.random.default_rng(config.seed).permutation(len(records))[: args.subset]
        records = [records[i] for i in sorted(chosen)]
    head = new_head(model, config.family, draft_vocab_size=len(vocab["used"]), seed=config.seed)
    if config.family == "eagle3":
        head.d2t = mx.array(vocab["d2t"])
        init_from_target(head, model, vocab["used"])
    trainer = Trainer(model, head, records, config, work, used=vocab["used"], progress=progress)
    if config.family == "eagle3" and not np.array_equal(np.array(head.d2t), vocab["d2t"]):
        raise UserError(f"the checkpoint in {work} was trained with another draft vocabulary than {vocab_path}; "
                        "pass a new --work")
    trainer.run()
    if world.rank() != 0:
        return
    save_head(head, args.out, dtype=getattr(mx, args.save_dtype))
    plot_curves(work / "log.jsonl", work / "curves.png")
    # Measured on the head as written (saved dtype), as users will load it.
    result = acceptance_by_depth(model, tokenizer, load_head(args.out, model), held_out)
    result.update(prompts=args.prompts, answers=args.answers, steps=config.steps,
                  tokens=int(sum(len(r["tokens"]) - r["prompt_length"] for r in records)))
    (work / "eval.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}; held-out tau {result['tau']:.2f}, acceptance by depth "
          + " ".join(f"{r:.2f}" for r in result["acceptance_by_depth"]))


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
