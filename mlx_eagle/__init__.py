"""mlx-eagle: EAGLE speculative decoding on MLX, lossless by construction."""

import os

# transformers warns on import that PyTorch is absent; mlx-eagle never needs it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from .models import DEFAULT_MODEL, load_target, resolve_model  # noqa: E402

__all__ = ["DEFAULT_MODEL", "load_target", "resolve_model"]
