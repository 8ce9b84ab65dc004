"""Fill-in-the-middle: the prompt for completing code between the text before the cursor
and the text after it, from the model's own fill-in-the-middle tokens.

The tokens are read from the tokenizer's added tokens, by what they say rather than by the
model's name: a prefix, a suffix and a middle marker, spelled as the families that train
them spell them (Qwen2.5-Coder's ``<|fim_prefix|>``, StarCoder2's ``<fim_prefix>``,
DeepSeek-Coder's ``<｜fim▁begin｜>``/``hole``/``end``, CodeLlama's ``<PRE>``/``<SUF>``/``<MID>``).
The prompt is prefix-suffix-middle: ``PRE prefix SUF suffix MID``, and the model writes the
middle. Other files of the project (llama.cpp's ``input_extra``) go first, each behind the
model's file separator (``<|file_sep|>`` name, then text), as repository-level training laid
them out; a model without a separator reads them as plain text before the prefix. Context
drafts read the whole prompt, so the suffix and the other files are drafted from as well:
code repeats its own identifiers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import UserError

MARKERS = {  # what each marker's text says, in the spellings of the families that have them
    "prefix": re.compile(r"<[|｜]?fim[_▁-]?(prefix|pre|begin)[|｜]?>|▁?<PRE>", re.I),
    "suffix": re.compile(r"<[|｜]?fim[_▁-]?(suffix|suf|hole)[|｜]?>|▁?<SUF>", re.I),
    "middle": re.compile(r"<[|｜]?fim[_▁-]?(middle|mid|end)[|｜]?>|▁?<MID>", re.I),
    "file": re.compile(r"<[|｜]?file[_▁-]?sep(arator)?[|｜]?>", re.I),
}
# Tokens that end a middle, besides the model's end of sequence: its end of text, the
# fill-in-the-middle padding, a new file or repository, a marker (as llama.cpp ends infills).
ENDS = re.compile(r"<[|｜]?(end[_▁-]?of[_▁-]?text|fim[_▁-]?pad|file[_▁-]?sep|repo[_▁-]?name|EOT)[|｜]?>", re.I)


@dataclass(frozen=True)
class InfillTokens:
    prefix: int
    suffix: int
    middle: int
    file: Optional[int]  # the file separator, if the model has one
    ends: Tuple[int, ...]  # the tokens that end a middle (ENDS and the markers)


def added_tokens(tokenizer) -> Dict[int, Any]:
    """The tokenizer's added tokens by id (Hugging Face's ``AddedToken``s: ``content``, ``special``)."""
    return getattr(getattr(tokenizer, "_tokenizer", tokenizer), "added_tokens_decoder", None) or {}


def encode_as_text(tokenizer, text: str) -> List[int]:
    """``text`` a user wrote, tokenized as characters: a special token's text in it (a marker
    typed in code, ``<|im_end|>`` in a message) stays text, never the marker."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


def infill_tokens(tokenizer) -> Optional[InfillTokens]:
    """The model's fill-in-the-middle tokens (None: it has none)."""
    added = added_tokens(tokenizer)
    found: Dict[str, int] = {}
    ends = []
    for token_id, token in sorted(added.items()):
        text = getattr(token, "content", str(token))
        for role, pattern in MARKERS.items():
            if role not in found and pattern.fullmatch(text):
                found[role] = token_id
        if ENDS.fullmatch(text):
            ends.append(token_id)
    if not all(role in found for role in ("prefix", "suffix", "middle")):
        return None
    return InfillTokens(found["prefix"], found["suffix"], found["middle"], found.get("file"),
                        tuple(sorted(set(ends) | {found["prefix"], found["suffix"], found["middle"]})))


def check_extra(extra: Any, where: str = "input_extra") -> List[Dict[str, str]]:
    """Other files: a list of {"filename": ..., "text": ...}."""
    if extra is None:
        return []
    if not isinstance(extra, list) or not all(isinstance(e, dict) and isinstance(e.get("text"), str)
                                              and isinstance(e.get("filename", ""), str) for e in extra):
        raise UserError(f"{where} must be a list of {{'filename': ..., 'text': ...}} objects", where)
    return extra


@dataclass(frozen=True)
class InfillPrompt:
    ids: List[int]
    stop_tokens: Tuple[int, ...]  # what ends the middle besides the end of sequence: generate's stop_tokens


def infill_prompt(tokenizer, prefix: str, suffix: str, extra: Sequence[Dict[str, str]] = ()) -> InfillPrompt:
    """The prompt for writing what goes between ``prefix`` and ``suffix``, the ``extra``
    files ({"filename", "text"}) read first, and the tokens that end the middle; one line
    for a model without fill-in-the-middle tokens."""
    tokens = infill_tokens(tokenizer)
    if tokens is None:
        raise UserError("this model has no fill-in-the-middle tokens in its tokenizer; send the code before the cursor "
                        "alone (no suffix), or use a code model that has them (Qwen2.5-Coder, StarCoder2, CodeLlama)",
                        "suffix")

    def encode(text: str) -> List[int]:  # (as llama.cpp's /infill reads it: only the markers placed here are special)
        return encode_as_text(tokenizer, text)

    ids: List[int] = []
    for chunk in check_extra(list(extra)):
        name = chunk.get("filename", "")
        if tokens.file is not None:
            ids += [tokens.file] + encode(f"{name}\n{chunk['text']}\n")
        else:
            ids += encode(f"{name}\n{chunk['text']}\n\n" if name else f"{chunk['text']}\n\n")
    ids += [tokens.prefix] + encode(prefix) + [tokens.suffix] + encode(suffix) + [tokens.middle]
    return InfillPrompt(ids, tokens.ends)
