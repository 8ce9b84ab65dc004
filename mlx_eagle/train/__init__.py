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

from .evaluate import acceptance_by_depth, calibration_pieces, measure_acceptance
from .pieces import Piece, d2t_t2d, draft_vocabulary, make_batch, self_distilled_pieces, sharegpt_pieces
from .recipe import TrainConfig, epoch_batches, learning_rate, padded_length
from .store import StateStore
from .trainer import Trainer, head_to_train, plot_curves
from .ttt import TTTCache, eagle1_loss, eagle3_loss, shift, target_states, ttt_unroll

__all__ = ["Piece", "StateStore", "TTTCache", "TrainConfig", "Trainer", "acceptance_by_depth", "calibration_pieces",
           "d2t_t2d", "draft_vocabulary", "eagle1_loss", "eagle3_loss", "epoch_batches", "head_to_train",
           "learning_rate", "make_batch", "measure_acceptance", "padded_length", "plot_curves",
           "self_distilled_pieces", "shift", "sharegpt_pieces", "target_states", "ttt_unroll"]
