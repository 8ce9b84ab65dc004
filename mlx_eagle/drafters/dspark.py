"""DSpark block drafters (DeepSeek's DeepSpec; dspark_model.py): DFlash's backbone drafts a
block in one pass, a Markov head makes it semi-autoregressive, and a confidence head says,
for each draft, how likely the target is to accept it once the drafts before it were.

Each round the drafter reads the states the target just committed and drafts the next
block at once (as DFlash does), then proposes the prefix of it with the most expected
tokens per unit of what verifying it costs on this device's curve, each draft with its
confidence, which the round's admission (admit.py) weighs again beside the batch's other
rows: the question DSpark's own scheduler asks, with this device's measured costs. A head's confidences are only as good
as its training, so they pass through what this conversation saw accepted first: the
acceptance observed for each band of confidence (``Calibration``), a few rounds' worth
weighing as much as the head. Without a confidence head the chain is sized by measured
acceptance by position, as DFlash's is. Where nothing is expected to pay, no block is
drafted but one probe in 16 rounds. Drafts are fixed tokens, so verification keeps the
target's text exactly, greedy or sampled, whatever the confidences say.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..dspark_model import DSparkModel, load, recognizes  # noqa: F401 (the kind's hooks: its checkpoints)
from . import Budget, Outcome, Proposal
from .dflash import DFlashDrafter, block_source
from .kinds import DraftSettings, DraftSource

NAME = "dspark"


class Calibration:
    """Predicted against observed acceptance, in ``BINS`` equal bands of confidence: each
    draft verified (its drafts before it accepted) adds its confidence to its band and
    whether it was accepted. ``adjusted`` maps a confidence to its band's observed rate,
    shrunk towards the confidence itself by ``PRIOR`` pseudo-observations."""

    BINS = 10
    PRIOR = 8.0

    def __init__(self) -> None:
        self.count = np.zeros(self.BINS)
        self.predicted = np.zeros(self.BINS)  # summed confidences
        self.accepted = np.zeros(self.BINS)

    def band(self, confidence: np.ndarray) -> np.ndarray:
        return np.minimum((np.asarray(confidence) * self.BINS).astype(int), self.BINS - 1)

    def record(self, confidence: Sequence[float], proposed: int, accepted: int) -> None:
        """A chain of ``proposed`` drafts with these confidences had ``accepted`` accepted."""
        verified = np.asarray(confidence[:min(accepted + 1, proposed)], dtype=np.float64)
        bands = self.band(verified)
        np.add.at(self.count, bands, 1)
        np.add.at(self.predicted, bands, verified)
        np.add.at(self.accepted, bands, np.arange(len(verified)) < accepted)

    def adjusted(self, confidence: np.ndarray) -> np.ndarray:
        bands = self.band(confidence)
        return (self.accepted[bands] + self.PRIOR * confidence) / (self.count[bands] + self.PRIOR)

    def merge(self, other: "Calibration") -> None:
        self.count += other.count
        self.predicted += other.predicted
        self.accepted += other.accepted

    def error(self) -> float:
        """The expected calibration error: the bands' |predicted - observed|, weighted by drafts."""
        seen = self.count > 0
        return float(np.abs(self.predicted[seen] - self.accepted[seen]).sum() / max(self.count.sum(), 1))

    def table(self) -> List[dict]:
        """The bands seen: their range, drafts, mean confidence and observed acceptance."""
        return [{"band": [b / self.BINS, (b + 1) / self.BINS], "drafts": int(self.count[b]),
                 "predicted": float(self.predicted[b] / self.count[b]),
                 "observed": float(self.accepted[b] / self.count[b])}
                for b in range(self.BINS) if self.count[b]]


class DSparkDrafter(DFlashDrafter):
    """A DSpark drafter proposing the chain it drafted as soon as the target committed its
    last tokens, each draft with its (calibrated) confidence."""

    def __init__(self, model: DSparkModel, target: nn.Module, pricing: Callable[[int], float],
                 max_tokens: Optional[int] = None, block_cost: float = 0.0):
        super().__init__(model, target, pricing, max_tokens, trees=False, block_cost=block_cost)
        self.calibration = Calibration()
        self._confidence: Optional[np.ndarray] = None  # the last proposal's raw confidences

    @staticmethod
    def drafts_per_block(block_size: int) -> int:
        """Every block position drafts the token after it, the root's included."""
        return block_size

    def twin(self) -> "DSparkDrafter":
        twin = super().twin()
        twin.calibration = Calibration()
        twin.calibration.merge(self.calibration)
        return twin

    @staticmethod
    def draft_rows(drafting: Sequence[Tuple["DSparkDrafter", int, int]]) -> List[Tuple[mx.array, Optional[mx.array]]]:
        """The blocks of several conversations sharing one model (drafter, root token, the
        root's position), in one pass: each block's tokens, left to right through the Markov
        head, and their confidences (None without a confidence head)."""
        model, target = drafting[0][0].model, drafting[0][0].target
        tokens, confidences = model.draft_blocks(target, [(root_token, drafter.cache, root)
                                                          for drafter, root_token, root in drafting])
        return [(tokens[row], None if confidences is None else confidences[row]) for row in range(len(drafting))]

    def learn(self, outcome: Outcome) -> None:
        proposed = len(outcome.proposal)  # as admitted: the prefix that paid
        self.record_chain(0, proposed, outcome.accepted)
        if self._confidence is not None:
            self.calibration.record(self._confidence, proposed, outcome.accepted)

    def propose(self, budget: Budget) -> Optional[Proposal]:
        self.price(budget)
        limit = min(budget.room, budget.nodes, self.max_tokens)
        self._confidence = None
        if limit < 1 or self.block is None:
            return None
        tokens, confidence = self.block
        if confidence is None:
            length = self.best_length(0, limit, budget.verified, budget.expected)
            return Proposal.chain(tokens[:length]) if length else None
        raw = np.array(confidence[:limit], dtype=np.float64)
        adjusted = self.calibration.adjusted(raw)
        length = self.best_prefix(np.cumprod(adjusted), budget.verified, budget.expected)
        if not length:
            return None
        self._confidence = raw[:length]
        return Proposal.chain(tokens[:length], adjusted[:length].tolist())


def accepts(draft: object) -> bool:
    return isinstance(draft, DSparkModel)


def source(draft: DSparkModel, model: nn.Module, settings: DraftSettings) -> DraftSource:
    # Chains only, as DSpark drafts them: --tree chain:K caps them at K drafts.
    return block_source(draft, model, settings, NAME, lambda pricing, limit, block_cost: DSparkDrafter(
        draft, model, pricing, max_tokens=limit, block_cost=block_cost))
