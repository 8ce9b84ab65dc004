"""mlx-eagle: speculative decoding on MLX (EAGLE heads, drafts from the context, your own
drafters), lossless by construction. The names and habits of mlx-lm::

    from mlx_eagle import load, stream_generate
"""

import importlib
import os

# transformers warns on import that PyTorch is absent; mlx-eagle never needs it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# The command's package (python -m mlx_eagle.generate; a light face over mlx_eagle.generation)
# is imported now and its name unbound, so that ``mlx_eagle.generate`` is the API function, as
# mlx_lm's is, even after the command runs: a package already imported is not bound again.
from . import generate  # noqa: E402

del generate

# Imported on first use, so that a command's --help need not load MLX's model code (mlx-lm
# and transformers take seconds to import).
_EXPORTS = {
    "GenerationResponse": "generation", "generate": "generation", "stream_generate": "generation",
    "BatchResponse": "scheduler", "batch_generate": "scheduler",
    "DEFAULT_MODEL": "models", "load": "plan", "load_target": "models", "resolve_model": "models",
    "PromptCache": "prompt_cache", "make_prompt_cache": "prompt_cache",
    "DraftPlan": "plan", "load_draft": "plan", "plan_drafts": "plan",
    "Budget": "drafters", "Drafter": "drafters", "Outcome": "drafters", "Proposal": "drafters",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
