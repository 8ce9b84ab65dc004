"""Replies of earlier requests to one model, indexed for drafting (suffix decoding).

Every ``KEY``-token window of every reply maps to where it occurred (its most recent
``OCCURRENCES``); a lookup follows each occurrence back to see how long it matches the
end of the text, and returns what followed the longest matches. Bounded: once more than
``max_tokens`` are held the oldest replies go first. In memory for one process and one
model (``for_model``); persisted on request (``History.open``) to a file of 0600
permissions, written atomically under a lock, merged with what other processes wrote,
and capped in bytes, oldest replies evicted first. A history archive that is damaged, or
written for another model, is rebuilt with one warning line; any other file (one that is not
a history archive, or a symbolic link) is refused in one line before anything is written,
never replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import sys
import weakref
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..architectures import target_identity
from ..errors import UserError
from ..files import check_history_file, write_atomically

FORMAT = "mlx-eagle history 1"
FILE_OVERHEAD = 1024  # bytes of a history file that are not its tokens (the archive, the header)
# At most this many tokens held in memory: about 85 MB with the index (benchmarks/history_size.py:
# 84 bytes a token over 10,000 replies), some 7,000 replies of 150 tokens.
MAX_TOKENS = 1_000_000
MAX_FILE_BYTES = 4 << 20  # a history file's cap: about a million tokens


class History:
    KEY = 3  # tokens in an indexed window
    OCCURRENCES = 16  # most recent occurrences kept per window

    def __init__(self, identity: str = "", max_tokens: int = MAX_TOKENS, path: Optional[Path] = None,
                 max_bytes: Optional[int] = None):
        self.identity, self.max_tokens, self.path, self.max_bytes = identity, max_tokens, path, max_bytes
        self.replies: "OrderedDict[int, np.ndarray]" = OrderedDict()
        # window (its KEY tokens packed in one int) -> occurrence (reply number << 24 | end), or a
        # list of them, oldest first: ints rather than tuples, a third of the memory
        self.index: Dict[int, object] = {}
        self.held = 0  # tokens in the replies held
        self.stale = 0  # tokens of evicted replies still named in the index
        self.next_id = 0
        self.added: List[np.ndarray] = []  # replies added since the file was last read or written

    def __len__(self) -> int:
        return len(self.replies)

    def add(self, tokens: Sequence[int], save: bool = True) -> None:
        """A finished reply (its tokens); saved to the file, when there is one."""
        reply = np.asarray(tokens, dtype=np.int32)[: (1 << 24) - 1]
        if len(reply) <= self.KEY or reply.min() < 0 or reply.max() >= 1 << 21:
            return
        self._insert(reply)
        if self.path is not None:
            self.added.append(reply)
            if save:
                self.save()

    @staticmethod
    def _window(tokens: Sequence[int]) -> int:
        first, second, third = tokens
        return (first << 42) | (second << 21) | third  # token ids below 2**21

    def _index(self, number: int, values: List[int]) -> None:
        index, window = self.index, self._window
        for end in range(self.KEY, len(values)):  # the window ending before ``end``, followed by values[end]
            key, occurrence = window(values[end - self.KEY:end]), (number << 24) | end
            held = index.get(key)
            if held is None:
                index[key] = occurrence
            elif isinstance(held, int):
                index[key] = [held, occurrence]
            else:
                held.append(occurrence)
                if len(held) > self.OCCURRENCES:
                    del held[0]

    def _insert(self, reply: np.ndarray) -> None:
        number, self.next_id = self.next_id, self.next_id + 1
        self.replies[number] = reply
        self.held += len(reply)
        self._index(number, reply.tolist())
        while self.held > self.max_tokens and len(self.replies) > 1:
            _, oldest = self.replies.popitem(last=False)
            self.held -= len(oldest)
            self.stale += len(oldest)
        if self.stale > max(self.held, 1 << 16):  # drop what the index still holds of evicted replies
            self._reindex()

    def _reindex(self) -> None:
        self.index, self.stale = {}, 0
        for number, reply in self.replies.items():
            self._index(number, reply.tolist())

    def match(self, context: Sequence[int], max_match: int, depth: int) -> Tuple[int, List[np.ndarray]]:
        """(how many of the context's last tokens an earlier reply holds, up to ``max_match``;
        what followed each occurrence of that longest match, up to ``depth`` tokens)."""
        if len(context) < self.KEY:
            return 0, []
        if any(not 0 <= t < 1 << 21 for t in context[-self.KEY:]):
            return 0, []
        held = self.index.get(self._window(context[-self.KEY:]), ())
        best, found = 0, []
        for occurrence in ([held] if isinstance(held, int) else held):
            number, end = occurrence >> 24, occurrence & ((1 << 24) - 1)
            reply = self.replies.get(number)
            if reply is None or end >= len(reply):
                continue
            length = self.KEY
            while length < max_match and length < len(context) and end - length - 1 >= 0 \
                    and reply[end - length - 1] == context[-length - 1]:
                length += 1
            if length > best:
                best, found = length, [reply[end:end + depth]]
            elif length == best:
                found.append(reply[end:end + depth])
        return best, found

    def clear(self) -> None:
        self.replies.clear()
        self.index, self.held, self.stale, self.added = {}, 0, 0, []
        if self.path is not None:
            self.save(replace=True)

    # Persisting

    @classmethod
    def open(cls, path: Path, identity: str, max_bytes: int = MAX_FILE_BYTES) -> "History":
        """The history in ``path`` for the model ``identity`` (an empty one where there is
        none yet; rebuilt, with one warning line, where the file is damaged or another
        model's); read once per process."""
        path = check_history_file(path)
        known = _FILES.get((path, identity, max_bytes))
        if known is not None:
            return known
        history = cls(identity, max_tokens=max(min(max_bytes // 4, MAX_TOKENS), 1), path=path, max_bytes=max_bytes)
        for reply in history._read():
            history._insert(reply)
        _FILES[(path, identity, max_bytes)] = history
        return history

    def _read(self) -> List[np.ndarray]:
        if self.path is None or not self.path.exists():
            return []
        try:
            limit = 2 * (self.max_bytes or 1 << 62) + (1 << 20)
            if self.path.stat().st_size > limit:
                raise ValueError("far larger than its cap")
            with zipfile.ZipFile(self.path) as archive:  # what its entries unpack to, before they are
                if sum(entry.file_size for entry in archive.infolist()) > limit:
                    raise ValueError("its entries unpack to far more than its cap")
            with np.load(self.path, allow_pickle=False) as data:
                header = json.loads(bytes(data["header"]).decode())
                if header.get("format") != FORMAT:
                    raise ValueError("not a history file")
                if header.get("identity") != self.identity:
                    raise ValueError("written for another model")
                tokens, lengths = data["tokens"].astype(np.int32), data["lengths"].astype(np.int64)
            if lengths.sum() != len(tokens) or (lengths < 0).any():
                raise ValueError("its lengths do not add up")
            return np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []
        except Exception as exc:  # a damaged or foreign file is rebuilt, not believed
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"warning: starting a new history: {self.path} is unusable ({reason[:120]})", file=sys.stderr)
            return []

    def save(self, replace: bool = False) -> None:
        """Write the file: what is on disk (another process may have added to it) and what
        this process added since, capped at ``max_bytes`` with the oldest replies evicted."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                replies = ([] if replace else self._read_quietly()) + self.added
                budget = (self.max_bytes or 1 << 62) - FILE_OVERHEAD
                kept, total = [], 0
                for reply in reversed(replies):  # the newest first, until the cap
                    if total + 4 * len(reply) + 4 > budget:
                        break
                    kept.append(reply)
                    total += 4 * len(reply) + 4
                kept.reverse()
                buffer = io.BytesIO()
                header = json.dumps({"format": FORMAT, "identity": self.identity}).encode()
                np.savez(buffer, header=np.frombuffer(header, dtype=np.uint8),
                         tokens=np.concatenate(kept) if kept else np.zeros(0, np.int32),
                         lengths=np.array([len(r) for r in kept], dtype=np.int32))
                write_atomically(self.path, buffer.getvalue(), mode=0o600)
                self.added = []
        except OSError as exc:
            raise UserError(f"cannot write the history {self.path} ({exc.strerror}); pass another --history or "
                            "--no-history") from None

    def _read_quietly(self) -> List[np.ndarray]:
        with contextlib.redirect_stderr(io.StringIO()):
            return self._read()


def model_identity(model) -> str:
    """What a history is kept for: the model's architecture and a sample of its weights."""


    digest = hashlib.sha256(json.dumps(target_identity(model), sort_keys=True, default=str).encode())
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embedding is not None:  # a fine-tune of the same architecture is another model
        digest.update(np.array(embedding(mx.arange(8)).astype(mx.float32)).tobytes())
    return digest.hexdigest()[:16]


_FILES: Dict[Tuple[Path, str, int], History] = {}  # the histories read from files, per process

# One in-memory history per model object (weakly held) and key (the server keeps one per
# requested model id): what a process has drafted from so far.
_HISTORIES: Dict[Tuple[int, str], Tuple["weakref.ref", History]] = {}


def for_model(model, key: str = "") -> History:
    known = _HISTORIES.get((id(model), key))
    if known is not None and known[0]() is model:
        return known[1]
    history = History(model_identity(model))
    _HISTORIES[(id(model), key)] = (weakref.ref(model), history)
    return history


def forget_history(model, key: str) -> None:
    """Drop the in-memory history kept for ``model`` and ``key`` (a server's model id no
    longer asked for)."""
    _HISTORIES.pop((id(model), key), None)
