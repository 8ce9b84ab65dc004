"""Long prompts' caches kept on disk, so that a restarted server, or the next session of an
agent whose every session begins with the same 6–30k tokens, does not read them again.

An entry is one safetensors file in mlx-lm's prompt-cache format (``save_prompt_cache``),
its metadata holding the tokens it holds and what computed them: the model (its
architecture and a sample of every weight), the device and BLAS, MLX's version and the
KV-cache settings. Only an entry computed as this process would compute it is read, so
it holds exactly what reading its tokens here would: the text stays plain decoding's.

What is kept: a conversation's caches once they hold at least ``MIN_TOKENS`` tokens that
no entry holds (a prompt read, a cancelled read's finished chunks, a reply), written when
its reply ends, beside its place and renamed. An entry that a newer one extends is
removed (the newer serves every prompt it served); past ``max_bytes`` the least recently
used go. A file that is damaged or not an entry is removed with one warning. Caches that
cannot be cut back (a hybrid model's recurrent state) are not kept: a prompt that shares
only part of them could not use them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, load_prompt_cache, save_prompt_cache

from .costs import device_key
from .drafters import common_prefix
from .drafters.history import model_identity
from .errors import PROMPT_DISK_BYTES
from .files import staged
from .target import KVQuantization, make_cache

WORTH_LOADING = 256  # fewer tokens more than a kept conversation holds are read, not loaded
MIN_TOKENS = 2048  # fewer new tokens are read again in under a minute here, and in seconds on a Mac
STAGED = ".partial.safetensors"  # (MLX adds .safetensors to a name that lacks it)
MAX_HEADER_BYTES = 64 << 20  # an entry's header: its tokens as text, a few hundred kilobytes


def store_key(model: nn.Module, kv: Optional[KVQuantization]) -> str:
    """What an entry's caches depend on: the model (architecture, and the first and last
    values of every weight: a fine-tune changes them all), the device and BLAS, MLX's
    version and the KV-cache quantization."""
    digest = hashlib.sha256(f"{model_identity(model)} {device_key(model)} {mx.__version__} {kv}".encode())
    for _, weight in tree_flatten(model.parameters()):
        flat = weight.reshape(-1)
        digest.update(np.array(mx.concatenate([flat[:4], flat[-4:]]).astype(mx.float32)).tobytes())
    return digest.hexdigest()[:24]


def read_tokens(path: Path) -> List[int]:
    """The tokens an entry holds, from its header alone (a ValueError where it is not one)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes")
        metadata = json.loads(file.read(length)).get("__metadata__", {})
    tokens = json.loads(metadata["0.tokens"])
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError("its tokens are not a list of token ids")
    return tokens


@dataclass
class Entry:
    path: Path
    tokens: List[int]


class PromptStore:
    """The entries of one model on one device (``store_key``) in ``directory``, all models'
    entries together under ``max_bytes``."""

    def __init__(self, directory: Path, model: nn.Module, kv: Optional[KVQuantization] = None,
                 max_bytes: int = PROMPT_DISK_BYTES):
        self.root, self.model, self.max_bytes = Path(directory), model, max_bytes
        self.directory = self.root / store_key(model, kv)
        self.classes = [type(layer).__name__ for layer in make_cache(model)]
        self.entries: List[Entry] = []
        for leftover in self.directory.glob(f".*{STAGED}"):  # a writer killed mid-file (a live one takes seconds)
            with contextlib.suppress(OSError):
                if time.time() - leftover.stat().st_mtime > 3600:
                    leftover.unlink()
        for path in sorted(self._files(self.directory)):
            try:
                self.entries.append(Entry(path, read_tokens(path)))
            except (OSError, ValueError, KeyError, struct.error) as exc:
                self._drop(path, exc)

    def best(self, prompt: List[int]) -> tuple:
        """(shared tokens, entry): the entry sharing the longest beginning with ``prompt``."""
        return max(((common_prefix(entry.tokens, prompt), entry) for entry in self.entries),
                   key=lambda pair: pair[0], default=(0, None))

    def load(self, entry: Entry) -> Optional[List]:
        """The target caches ``entry`` holds (its tokens but the last), or None (damaged,
        gone: it is then removed with one warning)."""
        try:
            cache, metadata = load_prompt_cache(str(entry.path), return_metadata=True)
            if [type(layer).__name__ for layer in cache] != self.classes:
                raise ValueError("its caches are not this model's")
            if any(layer.offset != len(entry.tokens) - 1 for layer in cache):
                raise ValueError("its caches do not hold its tokens")
            mx.eval([layer.state for layer in cache])
            entry.path.touch()  # recently used
            return cache
        except Exception as exc:  # (a damaged file fails anywhere in MLX's reader)
            self.entries.remove(entry)
            self._drop(entry.path, exc)
            return None

    def keeps(self, target: List, tokens: List[int], stored: int, size: int) -> bool:
        """Whether caches holding ``tokens`` (the last not read yet) in ``size`` bytes, of
        which the first ``stored`` are in an entry already, are worth an entry of their own."""
        return (len(tokens) - 1 - stored >= MIN_TOKENS and can_trim_prompt_cache(target) and size <= self.max_bytes
                and not any(common_prefix(entry.tokens, tokens) == len(tokens) for entry in self.entries))

    def save(self, target: List, tokens: List[int]) -> None:
        """Keep ``target`` holding ``tokens`` (the last not read yet); drop the entries it
        extends, then the least recently used past the bound. A disk that refuses only
        means reading again: one warning."""
        path = self.directory / f"{hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:24]}.safetensors"
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # (prompts are private)
            with staged(path, mode=0o600, suffix=STAGED) as staging:
                save_prompt_cache(str(staging), target, {"tokens": json.dumps(tokens)})
        except Exception as exc:  # (a full disk: MLX raises a RuntimeError)
            print(f"warning: not keeping a prompt's cache on disk: writing {path} failed ({exc})", file=sys.stderr)
            return
        extended = [entry for entry in self.entries if common_prefix(entry.tokens, tokens) == len(entry.tokens)]
        for entry in extended:
            self.entries.remove(entry)
            entry.path.unlink(missing_ok=True)
        self.entries.append(Entry(path, list(tokens)))
        self._bound(keep=path)

    def _bound(self, keep: Path) -> None:
        """Remove the least recently used files (every model's) until all fit the bound."""
        sizes = {}
        for path in (p for directory in self.root.iterdir() for p in self._files(directory)):
            with contextlib.suppress(OSError):  # (another server may remove one meanwhile)
                sizes[path] = path.stat()
        total = sum(stat.st_size for stat in sizes.values())
        for path in sorted(sizes, key=lambda p: sizes[p].st_mtime):
            if total <= self.max_bytes:
                break
            if path != keep:
                total -= sizes[path].st_size
                path.unlink(missing_ok=True)
                self.entries = [entry for entry in self.entries if entry.path != path]

    @staticmethod
    def _files(directory: Path) -> List[Path]:
        """The entries in ``directory`` (not the files being written, hidden)."""
        return [p for p in directory.glob("*.safetensors") if not p.name.startswith(".")] if directory.is_dir() else []

    @staticmethod
    def _drop(path: Path, reason: BaseException) -> None:
        print(f"warning: removing the prompt cache {path}: it is unusable ({str(reason)[:120]}); its prompt will "
              "be read again", file=sys.stderr)
        with contextlib.suppress(OSError):
            path.unlink()
