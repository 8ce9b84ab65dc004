"""One model over several machines: mlx-lm's sharded models under ``mx.distributed``.

``mlx.launch`` starts one process per rank; each loads its shard of the target through
mlx-lm's own ``sharded_load`` (tensor parallel through the model's ``shard()``, or
pipelined through ``model.model.pipeline()``), and every forward pass is a collective: each
rank must run the same passes over the same tokens, in the same order, or they wait on
each other for ever. So every choice that shapes a forward pass is made once, on rank 0,
and sent to the others:

- the draft tree of each round (``shared_proposal``): rank 0's drafters draft; the others
  verify rank 0's tree, whatever their own drafters (their own history files, timings)
  proposed. The target's logits are identical on every rank (a tensor-parallel layer ends in
  an all-sum, a pipeline in an all-gather), so the walk along the tree, and with the same
  random keys the sampling, commits the same tokens everywhere;
- the measured costs (``first_rank``): the logit drift decides which greedy positions are read
  again alone, one more forward pass;
- the random seed (``shared_seed``).

A rank that dies ends the others at their next collective ("connection to a peer was
lost"); a rank that hangs is caught by a watchdog (``Watchdog``) on the others, which ends
every rank with one line after ``RANK_TIMEOUT`` seconds without progress; mlx.launch then
stops the rest. Ranks that loaded different weights, or run other versions, are told
apart at load (``check_same``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import load_model, sharded_load

from .cli import ECHO_WAIT
from .errors import UserError
from .trees import DraftTree

# Seconds a rank waits for the others to finish one step (a prefill chunk, a round) before it
# decides one of them hangs. Long enough for a 512-token chunk of a very large model.
RANK_TIMEOUT = float(os.environ.get("MLX_EAGLE_RANK_TIMEOUT", "120"))


def world() -> mx.distributed.Group:
    """The group of every rank (a group of one without mlx.launch)."""
    return mx.distributed.init()


def sharded() -> bool:
    return world().size() > 1


def rank() -> int:
    return world().rank()


def first_rank(values: mx.array) -> mx.array:
    """Rank 0's ``values`` on every rank (the others' are ignored)."""
    group = world()
    if group.size() == 1:
        return values
    mine = values if group.rank() == 0 else mx.zeros_like(values)
    return mx.distributed.all_sum(mine, group=group)


def first_rank_numbers(values: Sequence[float]) -> List[float]:
    """Rank 0's numbers on every rank, as float32: every rank, rank 0 too, then uses the
    very same values."""
    if not sharded():
        return list(values)
    return np.array(first_rank(mx.array(values, dtype=mx.float32))).tolist()


def every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    if not sharded():
        return flag
    return int(mx.distributed.all_sum(mx.array(int(bool(flag)))).item()) == world().size()


def shared_seed(seed: Optional[int]) -> Optional[int]:
    """The seed every rank samples with: ``seed``, or one rank 0 draws (None alone: MLX's
    global generator, as plain mlx-lm samples)."""
    if not sharded():
        return seed
    drawn = seed if seed is not None else int(np.random.default_rng().integers(0, 2**31 - 1))
    return int(first_rank(mx.array(drawn, dtype=mx.int32)).item())


def share_message(message: Optional[dict]) -> dict:
    """Rank 0's ``message`` (JSON-able) on every rank: ``None`` on the others, which wait for it."""
    data = json.dumps(message).encode() if world().rank() == 0 else b""
    size = int(first_rank(mx.array(len(data), dtype=mx.int32)).item())
    shared = first_rank(mx.array(np.frombuffer(data, dtype=np.uint8)) if data else mx.zeros(size, dtype=mx.uint8))
    return json.loads(bytes(np.array(shared)).decode())


def check_same(text: str, what: str, fix: str) -> None:
    """One line, on every rank, naming the first rank whose ``text`` differs from rank 0's."""
    if not sharded():
        return
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], dtype=np.int32)
    gathered = np.array(mx.distributed.all_gather(mx.array(digest)[None]))
    odd = [r for r in range(1, len(gathered)) if not np.array_equal(gathered[r], gathered[0])]
    if odd:
        raise UserError(f"rank {odd[0]}'s {what} differs from rank 0's: {fix}", shared=True)


def model_fingerprint(path: Path) -> str:
    """What must be the same on every rank: the model's config and its weight files' names and sizes."""
    files = sorted((p.name, p.stat().st_size) for p in path.glob("*.safetensors"))
    return json.dumps([(path / "config.json").read_text(), files])


def versions() -> str:
    return ", ".join(f"{name} {version(name)}" for name in ("mlx", "mlx-lm", "mlx-eagle"))


def tensor_split_problem(model: nn.Module, ranks: int) -> Optional[str]:
    """Why ``model``'s layers cannot be split ``ranks`` ways by heads and feed-forward
    width (None where they can): mlx-lm's ``shard()`` divides them without checking."""
    args = model.args
    sizes = {"attention heads": getattr(args, "num_attention_heads", None),
             "KV heads": getattr(args, "num_key_value_heads", None),
             "feed-forward width": getattr(args, "intermediate_size", None)}
    uneven = {name: size for name, size in sizes.items() if isinstance(size, int) and size % ranks}
    if not uneven:
        return None
    whole = [name for name, size in sizes.items() if isinstance(size, int)]
    counts = [n for n in range(2, 17) if all(sizes[name] % n == 0 for name in whole)]
    listed = ", ".join(f"{size} {name}" for name, size in uneven.items())
    return (f"its {listed} cannot be split over {ranks} ranks; run "
            + (f"{' or '.join(map(str, counts[:3]))} ranks" if counts else "it on one machine"))


def sharded_target(path: Path, tokenizer_config: Dict[str, Any], pipeline: bool) -> Tuple[nn.Module, Any]:
    """The model in ``path`` sharded over every rank by mlx-lm's ``sharded_load``: tensor
    parallel, or pipelined with ``pipeline``; one line where it cannot be."""
    group = world()
    check_same(versions(), "software (mlx, mlx-lm, mlx-eagle)", f"install the same versions everywhere ({versions()} "
               "on rank 0)")
    check_same(model_fingerprint(path), f"model in {path}", "copy the same model directory to every machine")
    skeleton, _ = load_model(path, lazy=True, strict=False)
    if pipeline and not hasattr(getattr(skeleton, "model", None), "pipeline"):
        raise UserError(f"{path} ({skeleton.model_type}) cannot be pipelined by mlx-lm; drop --pipeline to split "
                        "its layers by heads instead", shared=True)
    if not pipeline:
        if not hasattr(skeleton, "shard"):
            raise UserError(f"{path} ({skeleton.model_type}) cannot be split by heads by mlx-lm"
                            + ("; pass --pipeline" if hasattr(getattr(skeleton, "model", None), "pipeline") else ""),
                            shared=True)
        problem = tensor_split_problem(skeleton, group.size())
        if problem:
            raise UserError(f"{path} cannot be sharded: {problem}", shared=True)
    try:
        return sharded_load(str(path), group if pipeline else None, None if pipeline else group,
                            tokenizer_config=tokenizer_config)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(f"cannot shard the model in {path} ({str(exc).splitlines()[0]})") from None


def sharding(model: nn.Module) -> str:
    """How ``model`` is split over the ranks, in words ("" on one machine)."""
    return getattr(model, "sharding", "")


def shared_proposal(tree, tokens: mx.array, max_nodes: int):
    """Rank 0's draft tree and tokens on every rank: (tree, tokens, whether they are this
    rank's own). One small all-sum a round."""
    count = len(tree)
    packed = mx.concatenate([mx.array([count] + tree.parents + [0] * (max_nodes - count), dtype=mx.int32),
                             tokens.astype(mx.int32), mx.zeros(max_nodes - count, dtype=mx.int32)])
    shared = np.array(first_rank(packed))
    count = int(shared[0])
    parents = shared[1:1 + count].tolist()
    ids = shared[1 + max_nodes:1 + max_nodes + count].tolist()
    own = parents == tree.parents and (tree.tokens == ids if tree.tokens else
                                       bool(np.array_equal(np.array(tokens), np.array(ids))))
    if own:
        tree.tokens = ids
        return tree, mx.array(ids, dtype=mx.int32), True
    shared_tree = DraftTree()
    for token, parent in zip(ids, parents):
        shared_tree.add(token, parent)
    return shared_tree, mx.array(ids, dtype=mx.int32), False


class Watchdog:
    """Ends this process with one line when ``kick`` is not called for ``timeout`` seconds
    until ``stop``: another rank hangs, and this one waits for it inside a collective (where
    Python code cannot run, but this thread can). mlx.launch then stops the other ranks.
    Idle on one machine."""

    def __init__(self, timeout: float = RANK_TIMEOUT):
        self.timeout = timeout
        self._kicked = threading.Event()
        self._watching = sharded()
        if self._watching:
            threading.Thread(target=self._watch, daemon=True).start()

    def kick(self) -> None:
        self._kicked.set()

    def stop(self) -> None:
        self._watching = False
        self._kicked.set()

    def _watch(self) -> None:
        # The others wait a little longer: rank 0 says it, and mlx.launch stops them meanwhile.
        timeout = self.timeout + (ECHO_WAIT if rank() else 0)
        while self._watching:
            if not self._kicked.wait(timeout):
                print(f"error: rank {rank()} made no progress for {self.timeout:.0f} s: a rank hangs; every rank "
                      "stops (MLX_EAGLE_RANK_TIMEOUT sets the wait)", file=sys.stderr, flush=True)
                os._exit(1)
            self._kicked.clear()
