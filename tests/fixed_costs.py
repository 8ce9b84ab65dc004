"""This CPU's costs, fixed: what tests that are not about timing price drafts by, so that the
trees they draft, and so the paths they exercise, do not depend on the machine's load.

conftest.py puts these in place of the timers for the whole session (``costs.time_forwards``,
``calibrate.time_draft_step``); the curves they give are kept in the session's cache as
timed ones are, so the commands the tests start read them too."""

from typing import Dict, Sequence

import numpy as np
from mlx.utils import tree_flatten

from mlx_eagle.costs import CALIBRATION_SIZES, Costs

# SmolLM2's forward over k new tokens (256 cached) as timed on this repository's 2-core CPU,
# float32 with OpenBLAS, in ms.
SMOLLM2_MS = {1: 53.5, 2: 58.6, 3: 64.9, 4: 70.2, 6: 75.9, 8: 81.8, 12: 109.5, 16: 121.5, 32: 176.6}
CPU_COSTS = Costs(SMOLLM2_MS)
_SMOLLM2_PARAMETERS = 134_515_008
# A head's step over one tree depth against the target's forward over one token (SmolLM2's
# shipped EAGLE-3 head, timed here).
HEAD_STEP_SHARE = 0.1


def parameters(model) -> int:
    return sum(value.size for _, value in tree_flatten(model.parameters()))


def fixed_forward_ms(model, sizes: Sequence[int] = CALIBRATION_SIZES, context: int = 256, *_, **__) -> Dict[int, float]:
    """SmolLM2's curve scaled by the model's parameters, and by the context attended to (a
    forward after 2,048 entries costs about 1.5 times one after 256, on this CPU)."""
    scale = parameters(model) / _SMOLLM2_PARAMETERS * (1 + (context - 256) / 3584)
    known = sorted(SMOLLM2_MS)
    return {size: float(np.interp(size, known, [SMOLLM2_MS[k] for k in known])) * scale for size in sizes}


def fixed_draft_step_ms(model, head, *_, **__) -> float:
    return HEAD_STEP_SHARE * fixed_forward_ms(model, (1,))[1]


# SmolLM2's packed passes (target.packed_forward) over r rows of k tokens each, against its
# one-row forward over one token, as timed on this repository's CPU (costs.time_packed_passes).
PACKED_SHARE = {2: {1: 1.36, 3: 1.96}, 4: {1: 1.84, 3: 3.09}, 8: {1: 2.44, 3: 4.91}, 16: {1: 3.64, 3: 8.5}}


def fixed_packed_ms(model, *_, **__) -> Dict[int, Dict[int, float]]:
    one = fixed_forward_ms(model, (1,))[1]
    return {rows: {length: share * one for length, share in by_length.items()}
            for rows, by_length in PACKED_SHARE.items()}
