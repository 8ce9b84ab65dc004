"""``python -m mlx_eagle.generate`` (this package's __main__), and a face over the API
module, mlx_eagle.generation: its names are imported on first use, so that the command's
--help need not load MLX's model code (mlx-lm and transformers take seconds to import)."""

import importlib


def __getattr__(name: str):
    generation = importlib.import_module("..generation", __name__)
    try:
        value = getattr(generation, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value
