"""Converters into MLX: target models (GGUF, Hugging Face) and, later, EAGLE heads."""
