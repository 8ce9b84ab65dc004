"""The target's states stored once on disk, for runs that see the same pieces many times."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..architectures import target_identity
from ..errors import UserError
from ..files import write_atomically
from ..progress import progress_bar
from .pieces import Piece, make_batch
from .recipe import padded_length
from .ttt import target_states


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

        order = sorted(range(len(self.tokens)), key=lambda i: -len(self.tokens[i]))
        done = self._filled()
        bar = progress_bar(total=self.meta["tokens"], initial=sum(len(self.tokens[i]) for i in order[:done]),
                           unit="token", desc="target states", disable=not progress)
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
            # Only once the states it counts are on disk.
            write_atomically(self.path / "filled.json", json.dumps({"pieces": done}))
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
