"""Fetching models and drafters from the Hugging Face Hub, when online."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError

_HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]


def from_hub(repo_id: str) -> Path:
    """The local snapshot of the Hugging Face repo ``repo_id`` (downloaded once), or one line."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"cannot fetch {repo_id} from the Hugging Face Hub ({reason}); "
            "when offline, pass a local model directory or .gguf file"
        ) from None
