"""mlx-eagle: EAGLE speculative decoding on MLX, lossless by construction."""

import importlib
import os

# transformers warns on import that PyTorch is absent; mlx-eagle never needs it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# The command module mlx_eagle.generate first, the function of the same name after it:
# importing the command later would otherwise replace the function here.
importlib.import_module(f"{__name__}.generate")

from .decoder import PromptCache, make_prompt_cache  # noqa: E402
from .generation import GenerationResponse, generate, stream_generate  # noqa: E402
from .models import DEFAULT_MODEL, load, load_draft, load_target, resolve_model  # noqa: E402

__all__ = [
    "DEFAULT_MODEL", "GenerationResponse", "PromptCache", "generate", "load", "load_draft", "load_target",
    "make_prompt_cache", "resolve_model", "stream_generate",
]
