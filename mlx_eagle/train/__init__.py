"""Train a drafter (an EAGLE head or a DFlash block drafter) for any supported target, resumably.

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

import importlib

# Imported on first use, so that the command's --help need not load MLX's model code.
_EXPORTS = {
    "calibration_pieces": "evaluate", "chain_estimate": "evaluate", "evaluate_head": "evaluate",
    "measure_acceptance": "evaluate", "FAMILIES": "families", "TrainedFamily": "families",
    "drafter_to_train": "families", "Piece": "pieces", "d2t_t2d": "pieces", "draft_vocabulary": "pieces",
    "make_batch": "pieces", "self_distilled_pieces": "pieces", "sharegpt_pieces": "pieces",
    "TrainConfig": "recipe", "epoch_batches": "recipe", "learning_rate": "recipe", "padded_length": "recipe",
    "StateStore": "store", "Trainer": "trainer", "plot_curves": "trainer", "steps_within": "trainer",
    "TTTCache": "ttt", "head_to_train": "ttt", "shift": "ttt", "target_states": "ttt", "ttt_unroll": "ttt",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
