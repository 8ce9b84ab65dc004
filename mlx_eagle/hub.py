"""Fetching models and drafters from the Hugging Face Hub, when online."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from huggingface_hub import snapshot_download

from .errors import UserError

MODEL_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt")


def from_hub(repo_id: str, files: Sequence[str] = MODEL_FILES,
             offline: str = "pass a local model directory or .gguf file") -> Path:
    """The local snapshot of the Hugging Face repo ``repo_id`` (downloaded once: the
    ``files`` patterns), or one line saying what to ``offline`` pass instead."""
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(files)))
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"cannot fetch {repo_id} from the Hugging Face Hub ({reason}); when offline, {offline}") \
            from None
