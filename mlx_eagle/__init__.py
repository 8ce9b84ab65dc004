"""mlx-eagle: speculative decoding on MLX (EAGLE heads, drafts from the context, your own
drafters), lossless by construction. The names and habits of mlx-lm::

    from mlx_eagle import load, stream_generate
"""

import importlib
import os

# transformers warns on import that PyTorch is absent; mlx-eagle never needs it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# The API functions are bound over the subpackage of the same name (python -m
# mlx_eagle.generate runs its __main__), as mlx_lm binds its own.
from .generate import GenerationResponse, generate, stream_generate  # noqa: E402

# Everything else is imported on first use, so that a command's --help need not load MLX's
# model code (mlx-lm and transformers take seconds to import).
_EXPORTS = {
    "DEFAULT_MODEL": "models", "load": "plan", "load_target": "models", "resolve_model": "models",
    "PromptCache": "prompt_cache", "make_prompt_cache": "prompt_cache",
    "DraftPlan": "plan", "load_draft": "plan", "plan_drafts": "plan",
    "Budget": "drafters", "Drafter": "drafters", "Outcome": "drafters", "Proposal": "drafters",
}

__all__ = ["GenerationResponse", "generate", "stream_generate", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
