"""Progress bars that also read well in a log: tqdm on a terminal; elsewhere (a file, a
pipe, CI) a whole line at most every 30 s and one at the end, never carriage returns."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class _Lines:
    """A stream for tqdm that turns each redraw into a line of its own."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Any = None, **options: Any):
    """``tqdm(iterable, **options)``, on standard error, log-safe as the module says."""

    stream = options.pop("file", sys.stderr)
    if not (hasattr(stream, "isatty") and stream.isatty()):
        options.setdefault("mininterval", 30.0)
        options.update(file=_Lines(stream), leave=True, ncols=100, ascii=True)
    else:
        options["file"] = stream
    return tqdm(iterable, **options)


class PromptProgress:
    """``prompt_progress_callback`` for the commands: a bar while a long prompt is read
    (``at_least`` tokens or more to read), nothing for a short one."""

    def __init__(self, at_least: int = 2048):
        self.at_least = at_least
        self.bar = None

    def __call__(self, read: int, total: int) -> None:
        if self.bar is None and total >= self.at_least:
            self.bar = progress_bar(total=total, desc="reading the prompt", unit="token", leave=False)
        if self.bar is not None:
            self.bar.update(read - self.bar.n)
            if read >= total:
                self.bar.close()


def close_bars() -> None:
    """End any bar still drawn (a command failing inside its loop), so that the error
    that follows starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or []):
        bar.close()
