"""Every file and directory the program writes, written whole or not at all (a temporary
sibling, flushed to disk, renamed into place), and the small files it reads back, read
with limits: a full disk, a kill or a damaged file never leaves a half-written file, and
never reaches the user as a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import numpy as np

from .errors import UserError

MAX_JSON_BYTES = 1 << 20  # every JSON file here is a few kilobytes
STAGING = ".partial"  # how a file being written ends its name


def cache_dir() -> Path:
    """Where converted models, timings and tuned trees live: $MLX_EAGLE_CACHE, else the
    user's cache directory."""
    if os.environ.get("MLX_EAGLE_CACHE"):
        return Path(os.environ["MLX_EAGLE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-eagle"


@contextlib.contextmanager
def staged(path: Path, mode: int = 0o644, suffix: str = STAGING) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write (hidden, its name ending in ``suffix``),
    flushed to disk and renamed over ``path`` when the block ends: a reader sees the old
    file or the new one, never a part. On any error (a full disk) the temporary file is
    removed and the old file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(handle)
    try:
        yield Path(staging)
        with open(staging, "rb") as file:
            os.fsync(file.fileno())
        os.chmod(staging, mode)
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise


def write_atomically(path: Path, data: Union[bytes, str], mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` whole or not at all (``staged``)."""
    with staged(path, mode) as staging:
        staging.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def write_npz(path: Path, compressed: bool = False, **arrays: np.ndarray) -> None:
    """numpy arrays as an .npz at ``path``, atomically (a truncated archive would fail every
    later run that reads it)."""
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    write_atomically(path, buffer.getvalue())


def disk_error(exc: BaseException, path: Path) -> UserError:
    """One line for a write that failed (a full disk, a read-only directory)."""
    return UserError(f"writing {path} failed ({getattr(exc, 'strerror', None) or exc}); the previous file is kept. "
                     "Free some space or choose another directory")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's, and alive
        return True
    return True


def remove_leftovers(out: Path) -> None:
    """Remove staging directories for ``out`` left by runs that were killed (SIGKILL or a
    power cut leave no chance to clean up): those whose process is gone."""
    for leftover in out.parent.glob(f".{out.name}.*.partial"):
        pid = leftover.name[len(out.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _sync_tree(directory: Path) -> None:
    for file in directory.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def retired(out: Path) -> Path:
    """Where replace_directory keeps the previous ``out`` while it swaps the new one in: a
    kill between its two renames leaves the old directory here, whole."""
    return out.parent / f".{out.name}.old"


def replace_directory(out: Path, fill: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Have ``fill`` write a temporary sibling of ``out`` (and check it), flush it to disk,
    then rename it into place: ``out`` is all of it or nothing, also when ``fill`` fails or
    is interrupted (SIGTERM too: commands turn it into an exit that runs this cleanup)."""
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; choose another output directory or pass --overwrite")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(out)
        # The process id in the name tells a later run whether this one is still at work.
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".partial", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # as mkdir would make it, not mkdtemp's private 0700
    except OSError as exc:
        raise UserError(f"cannot write to {out.parent} ({exc.strerror}); choose a writable output directory") from exc
    try:
        fill(staging)
        _sync_tree(staging)
        old = retired(out)
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if is_write_failure(exc):  # a full disk, a vanished directory...
            kept = "the previous one is kept" if out.exists() or retired(out).exists() else "nothing was left behind"
            raise UserError(f"writing {out} failed ({getattr(exc, 'strerror', None) or exc}); {kept}. "
                            "Free some space or choose another output directory") from None
        raise
    return out


def is_write_failure(exc: BaseException) -> bool:
    """A write that the disk refused: an OSError, or MLX's RuntimeError for a safetensors
    file it could not write ("[write] Unable to write N bytes to file.")."""
    return isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and str(exc).startswith("[write]"))


def writable(directory: Path) -> bool:
    """Whether files can be made in ``directory`` (made first if it is not there)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def write_json(path: Path, record: Any) -> bool:
    """``record`` as JSON at ``path``, atomically; False where it cannot be written (a
    cache directory that is read-only or full only means doing the work again)."""
    try:
        write_atomically(path, json.dumps(record, indent=1))
        return True
    except OSError:
        return False


def read_limited(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, or ValueError saying in a few words why not: not a regular
    file, unreadable, or over ``max_bytes`` (no more than that is ever read)."""
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
    return data


def parse_json(data: bytes) -> Any:
    """The JSON value ``data`` holds, or ValueError: not UTF-8 JSON, or nested too deeply."""
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__})") from None


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in ``path``, read once for every JSON file the runtime opens, or
    ValueError saying in a few words why not (``read_limited``, ``parse_json``)."""
    return parse_json(read_limited(path, max_bytes))


def check_history_file(path: Path) -> Path:
    """``path`` (absolute) if a history can be kept there: a new file in a directory that
    can be made or written, or a history archive this program wrote; one line otherwise,
    before any model loads, so that a typo never destroys a user's file."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    if path.is_symlink():
        raise UserError(f"history file {path} is a symbolic link; pass the file it names, or another name")
    if path.exists():
        if not path.is_file():
            raise UserError(f"history file {path} is not a file; pass a file name")
        if not _is_history_archive(path):
            raise UserError(f"{path} is not a history file this program wrote; pass a new file's name (it would be "
                            "replaced)")
        if not os.access(path, os.R_OK | os.W_OK):
            raise UserError(f"history file {path} cannot be read and written; pass another --history or --no-history")
        return path
    try:  # made as saving makes it, and written to once: the only sure test
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise UserError(f"history file {path} cannot be written ({exc.strerror or exc}); pass another --history "
                        "or --no-history") from None
    return path


def _is_history_archive(path: Path) -> bool:
    """An empty file, or a zip archive holding a history's header (its contents are checked
    when it is read: a damaged history is rebuilt)."""
    if path.stat().st_size == 0:
        return True
    try:
        with zipfile.ZipFile(path) as archive:
            return "header.npy" in archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
