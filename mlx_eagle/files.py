"""Small files the program writes and reads back (caches, tuned trees, records), written
once: whole or not at all, and read with limits, so that a full disk, a kill or a
damaged file never leaves a half-written file or reaches the user as a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Union

MAX_JSON_BYTES = 1 << 20  # every JSON file here is a few kilobytes


def cache_dir() -> Path:
    """Where converted models, timings and tuned trees live: $MLX_EAGLE_CACHE, else the
    user's cache directory."""
    if os.environ.get("MLX_EAGLE_CACHE"):
        return Path(os.environ["MLX_EAGLE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-eagle"


def write_atomically(path: Path, data: Union[bytes, str], mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a temporary sibling that is flushed to disk and
    then renamed over it: a reader sees the old file or the new one, never a part. On any
    error (a full disk) the temporary file is removed and the old file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data.encode("utf-8") if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(staging, mode)
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise


def write_json(path: Path, record: Any) -> bool:
    """``record`` as JSON at ``path``, atomically; False where it cannot be written (a
    cache directory that is read-only or full only means doing the work again)."""
    try:
        write_atomically(path, json.dumps(record, indent=1))
        return True
    except OSError:
        return False


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in ``path``, or ValueError saying in a few words why not: unreadable,
    not a regular file, over ``max_bytes``, not UTF-8 JSON, or nested too deeply."""
    path = Path(path)
    try:
        if not path.is_file():
            raise ValueError("not a regular file")
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise ValueError(f"over {max_bytes} bytes")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
