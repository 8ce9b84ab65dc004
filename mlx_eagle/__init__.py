"""mlx-eagle: EAGLE speculative decoding on MLX, lossless by construction."""

import os
import sys
import types

# transformers warns on import that PyTorch is absent; mlx-eagle never needs it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class _Package(types.ModuleType):
    """Importing the command module mlx_eagle.generate (python -m does) makes Python set
    this package's ``generate`` to that module, hiding the function of the same name."""

    def __setattr__(self, name: str, value) -> None:
        if name == "generate" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

from .decoder import PromptCache, make_prompt_cache  # noqa: E402
from .generation import GenerationResponse, generate, stream_generate  # noqa: E402
from .models import DEFAULT_MODEL, load, load_draft, load_target, resolve_model  # noqa: E402

__all__ = [
    "DEFAULT_MODEL", "GenerationResponse", "PromptCache", "generate", "load", "load_draft", "load_target",
    "make_prompt_cache", "resolve_model", "stream_generate",
]
