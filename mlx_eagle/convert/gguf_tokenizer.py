"""Rebuild a Hugging Face fast tokenizer from the vocabulary stored in GGUF metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ..errors import UserError
from .gguf_weights import field

# llama.cpp token types (llama_token_type)
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> (the pre-tokenizer llama.cpp applies, BPE ignore_merges)
_BPE_PRE_TOKENIZERS: Dict[str, Callable[[], tuple]] = {
    "default": lambda: (pre_tokenizers.ByteLevel(add_prefix_space=False), False),
    "gpt-2": lambda: (pre_tokenizers.ByteLevel(add_prefix_space=False), False),
    "smollm": lambda: (
        pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]),
        False,
    ),
    "llama-bpe": lambda: (_split_then_bytes(_LLAMA3_SPLIT), True),
    "qwen2": lambda: (_split_then_bytes(_QWEN2_SPLIT), False),
}


def _byte_level_bpe(reader, tokens: List[str], path: Path) -> Tokenizer:
    pre_name = field(reader, "tokenizer.ggml.pre", "default")
    if pre_name not in _BPE_PRE_TOKENIZERS:
        raise UserError(
            f"{path}: GGUF pre-tokenizer {pre_name!r} is not supported (supported: "
            f"{', '.join(sorted(_BPE_PRE_TOKENIZERS))}); convert the Hugging Face model directory instead"
        )
    pre_tokenizer, ignore_merges = _BPE_PRE_TOKENIZERS[pre_name]()
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _sentencepiece_bpe(reader, tokens: List[str], types: List[int]) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral): merges are implied by the piece scores."""
    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    mergeable = [i for i, t in enumerate(types) if t not in (_CONTROL, _BYTE)]
    ranked = []
    for merged_id in mergeable:
        piece = tokens[merged_id]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[merged_id], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk_id = field(reader, "tokenizer.ggml.unknown_token_id", 0)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend("▁")] if field(reader, "tokenizer.ggml.add_space_prefix", True) else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def build_tokenizer(reader, path: Path, context_length: int):
    """A transformers fast tokenizer equal to the one llama.cpp builds from this file, or
    one line when its metadata is damaged."""
    try:
        return _build_tokenizer(reader, path, context_length)
    except UserError:
        raise
    except Exception as exc:  # the tokenizers library can fail many ways on bad metadata
        raise UserError(f"{path}: its tokenizer metadata is damaged ({type(exc).__name__}); "
                        "download the file again") from None


def _build_tokenizer(reader, path: Path, context_length: int):

    tokens = field(reader, "tokenizer.ggml.tokens")
    kind = field(reader, "tokenizer.ggml.model")
    if not tokens or kind is None:
        raise UserError(f"{path} carries no tokenizer (tokenizer.ggml.* metadata is missing); "
                        "convert the Hugging Face model directory instead")
    types = list(field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(reader, tokens, path)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(reader, tokens, types)
    else:
        raise UserError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

    tokenizer.add_tokens([
        AddedToken(tokens[i], special=(t == _CONTROL), normalized=False)
        for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)
    ])

    def token(key: str):
        index = field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and index < len(tokens) else None

    bos = token("bos")
    if field(reader, "tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        single = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
        existing = tokenizer.post_processor
        tokenizer.post_processor = single if existing is None else processors.Sequence([existing, single])

    specials = {
        "bos_token": bos,
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
    }
    wrapper = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        clean_up_tokenization_spaces=False,
        model_max_length=context_length,
        **{k: v for k, v in specials.items() if v is not None},
    )
    template = field(reader, "tokenizer.chat_template")
    if template:
        wrapper.chat_template = template
    return wrapper
