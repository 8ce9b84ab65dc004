"""Train the SmolLM2 head on a lent GPU inside a fixed wall-clock budget (MLX's CUDA backend).

    python results/gpu_train.py GGUF DATA_DIR OUT_DIR SECONDS [--ttt-steps 5] [--init HEAD] [--smoke]

DATA_DIR holds what ``python -m mlx_eagle.train --seq-len 2048 --prepare-only --data DATA_DIR``
wrote here (tokenized ShareGPT dialogues and the draft vocabulary), so the GPU only trains.
A probe of a few steps measures the step time; the run is then sized to end inside the
budget, and the head is exported to OUT_DIR (float16, in files of under 16 MiB) after
every chunk of steps, so a cut-off run still leaves its latest head behind. ``--init``
starts from a head this job exported before (results/gpu-run/head), so GPU sessions add
epochs to one head (a new warm-up and cosine schedule each time). ``--smoke``: a CPU
rehearsal with tiny batches and few pieces.
"""
import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

start = time.time()
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("gguf", type=Path)
parser.add_argument("data", type=Path)
parser.add_argument("out", type=Path)
parser.add_argument("seconds", type=float)
parser.add_argument("--ttt-steps", type=int, default=5)
parser.add_argument("--init", type=Path, help="a head this job exported before, to go on training")
parser.add_argument("--smoke", action="store_true")
args = parser.parse_args()
gguf, data, out, ttt_steps, smoke = args.gguf, args.data, args.out, args.ttt_steps, args.smoke
deadline = start + args.seconds
out.mkdir(parents=True, exist_ok=True)

from mlx_eagle.convert.target import convert_target  # noqa: E402
from mlx_eagle.heads import read_head_weights, save_head  # noqa: E402
from mlx_eagle.models import load  # noqa: E402
from mlx_eagle.train import Trainer, TrainConfig, head_to_train, sharegpt_pieces  # noqa: E402

print("device:", mx.default_device(), mx.device_info() if hasattr(mx, "device_info") else "", flush=True)
model_dir = convert_target(gguf, Path("/tmp/smollm2-bf16"), dtype="bfloat16", progress=False) \
    if not Path("/tmp/smollm2-bf16/config.json").exists() else Path("/tmp/smollm2-bf16")
model, tokenizer = load(str(model_dir))
pieces, held_out = sharegpt_pieces(tokenizer, data, 2048, None, 20, progress=False)
pieces = pieces[:200] if smoke else pieces
vocab = np.load(next(data.glob("vocab-sharegpt-all-*.npz")))
print(f"{len(pieces)} pieces, {sum(int(a.sum()) for _, a in pieces)} answer tokens, "
      f"{sum(len(t) for t, _ in pieces)} tokens; ready after {time.time() - start:.0f} s", flush=True)


def fresh_trainer(config: TrainConfig, work: Path) -> Trainer:
    head = head_to_train(model, "eagle3", vocab["used"], config.seed, config.train_embeddings)
    if args.init is not None:
        _, weights = read_head_weights(args.init)
        if not np.array_equal(np.array(weights["d2t"]), vocab["d2t"]):
            raise SystemExit(f"{args.init} drafts from another draft vocabulary than {data}")
        head.load_weights([(k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                           for k, v in weights.items()])
    return Trainer(model, head, pieces, config, work, used=vocab["used"], progress=False)


def export(trainer: Trainer, tag: str) -> None:
    """The head as float16 in two files (each under the 16 MiB a lent machine returns)."""
    directory = Path("/tmp/export")
    save_head(trainer.head, directory, dtype=mx.float16)
    weights = mx.load(str(directory / "model.safetensors"))
    mx.save_safetensors(str(out / "lm_head.safetensors"), {"lm_head.weight": weights.pop("lm_head.weight")})
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text((directory / "config.json").read_text())
    (out / "log.jsonl").write_text((trainer.work / "log.jsonl").read_text())
    (out / "summary.json").write_text(json.dumps({"tag": tag, "step": trainer.step, "config": asdict(trainer.config),
                                                  "elapsed_s": time.time() - start}, indent=2))
    print(f"exported step {trainer.step} ({tag}) at {time.time() - start:.0f} s", flush=True)


base = TrainConfig(steps=100000, tokens_per_batch=1024 if smoke else 16384, grad_accum=2, seq_len=2048, lr=5e-4, ttt_steps=ttt_steps,
                   pad_multiple=512, checkpoint_every=10**9)


def probe_step_times(config: TrainConfig) -> list:
    probe, times = fresh_trainer(config, Path(f"/tmp/probe-{config.compile}")), []
    for _ in range(4 if smoke else 10):
        tic = time.time()
        loss, losses, accuracies, seen = probe.train_step()
        probe.step += 1
        times.append(time.time() - tic)
        print(f"probe step {probe.step}: {times[-1]:.2f} s, {seen} answer tokens, loss {loss:.3f}", flush=True)
    return times


try:
    times = probe_step_times(base)
except Exception as exc:  # a backend without a working mx.compile for this step still trains
    print(f"compiled step failed ({exc!r}); training uncompiled", flush=True)
    base = replace(base, compile=False)
    times = probe_step_times(base)
step_time = float(np.median(times[len(times) // 3:]))
steps = max(2, int((deadline - time.time() - 45) / (step_time * 1.1)))
print(f"step {step_time:.2f} s (median after compiling): training {steps} steps", flush=True)
config = replace(base, steps=steps, warmup=max(20, steps // 30))
trainer = fresh_trainer(config, Path("/tmp/work"))
chunk = max(1, steps // 6)
while trainer.step < steps:
    trainer.run(stop_after=min(steps, trainer.step + chunk))
    export(trainer, "final" if trainer.step == steps else "partial")
    if time.time() > deadline - 30:
        break
print(f"done after {time.time() - start:.0f} s", flush=True)
