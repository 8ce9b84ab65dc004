"""Structured outputs: a reply held to a grammar (a JSON schema, or any JSON object), with
speculation on.

The grammar engine is llguidance (chosen by measurement, docs/benchmarks.md: a schema is
ready in about 1 ms, a mask over a 152k-token vocabulary takes 0.03-0.08 ms on this CPU,
it rolls back, and it names the tokens the grammar forces; it needs no torch).

A round's tree is shaped by the grammar before the target verifies it (``Grammar.shape``):
- every node whose token the grammar does not allow after its path is cut, with its
  subtree: its masked probability is 0, so it could never be accepted;
- the tokens the grammar forces after the drafter's best path (the first child from the
  root down) are grafted there: drafted for free, as context drafts are;
- each row the target computes, the root's and every node's, gets the grammar's mask of
  allowed tokens at that point of its path (``Shaped.allowed``), applied to the logits
  before the round accepts (``mask_logits``). Greedy choices and sampled distributions are
  then exactly those of plain decoding with the mask applied at each step, as mlx-lm
  applies a logits processor: the log-probabilities too are the masked ones.

The JSON is written as ``json.dumps`` writes it (", " and ": ", no other white space): a
rigid layout leaves no room for runs of white space, and makes keys and punctuation
forced tokens.
"""

from __future__ import annotations

import ast
import copy
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import llguidance
import mlx.core as mx
import numpy as np

from .drafters.composite import SourceStats
from .errors import UserError
from .files import read_json
from .trees import DraftTree

# How JSON is laid out (see the module's docstring).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Forced tokens grafted after the best path, at most: a long constant string is drafted in pieces.
MAX_FORCED = 16


def response_grammar(response_format: Any, where: str = "response_format") -> Optional[str]:
    """The grammar an OpenAI-style ``response_format`` asks for (None: plain text), checked:
    {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}. A bare JSON schema (an object with no
    "type" of those three) is taken as the schema itself. One line names the problem."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _field_error(f"{where} must be an object such as {{'type': 'json_object'}}", where)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise _field_error(f"{where}.json_schema must be an object with a 'schema' object", f"{where}.json_schema")
        schema = spec.get("schema", {})
        where = f"{where}.json_schema.schema"
    elif kind == "grammar":
        return format_grammar(response_format, where)
    else:
        raise _field_error(f"{where}.type must be 'text', 'json_object', 'json_schema' or 'grammar', not {kind!r}",
                           f"{where}.type")
    return schema_grammar(schema, where)


def format_grammar(spec: Dict[str, Any], where: str) -> str:
    """llguidance's grammar for OpenAI's grammar format (a custom tool's ``format``, or a
    ``response_format`` of this type): {"type": "grammar", "syntax": "lark" or "regex",
    "definition": ...}, checked with the engine."""
    syntax, definition = spec.get("syntax"), spec.get("definition")
    if syntax not in ("lark", "regex") or not isinstance(definition, str):
        raise _field_error(f"{where} must have syntax 'lark' or 'regex' and a definition string", where)
    if syntax == "lark":  # (llguidance has no Lark's common terminals to import: they are defined here)
        definition = re.sub(r"(?m)^\s*%import\s+common\.(\w+)\s*$",
                            lambda found: f"{found.group(1)}: /{LARK_COMMON[found.group(1)]}/"
                            if found.group(1) in LARK_COMMON else found.group(0), definition)
    try:
        grammar = (llguidance.LLMatcher.grammar_from_lark(definition) if syntax == "lark"
                   else llguidance.LLMatcher.grammar_from_regex(definition))
    except (ValueError, TypeError) as exc:
        raise _field_error(f"{where}.definition is not a {syntax} grammar: {_first_line(str(exc))}", where) from None
    return _followable(grammar, f"{where}.definition", where)


# Lark's common terminals a freeform tool's grammar may import, as regular expressions.
LARK_COMMON = {"LF": r"\n", "CR": r"\r", "NEWLINE": r"(\r?\n)+", "WS": r"[ \t\f\r\n]+", "WS_INLINE": r"[ \t]+",
               "DIGIT": "[0-9]", "INT": "[0-9]+", "LETTER": "[A-Za-z]", "WORD": "[A-Za-z]+"}
_LARK_TOKEN = re.compile(r'\s*(?:(?P<string>"(?:[^"\\\n]|\\.)*")|(?P<regex>/(?:[^/\\\n]|\\.)+/)'
                         r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<op>[()\[\]|?*+]))")


def lark_regex(definition: str) -> Optional[str]:
    """A regular Lark grammar (no rule reaches itself: Codex's ``apply_patch`` is one) as one
    regular expression over its text; None where it is not regular or uses what this reader
    does not (priorities, templates, ``%ignore``, flags on literals, imports beyond
    LARK_COMMON). A call's text is held to it inside the call's JSON string."""
    rules: Dict[str, str] = {}
    name = None
    for line in definition.splitlines():
        line = re.sub(r"(^|\s)(//|#).*$", "", line).rstrip()
        if not line.strip():
            continue
        imported = re.fullmatch(r"%import\s+common\.(\w+)", line.strip())
        if imported and imported.group(1) in LARK_COMMON:
            continue
        if line.lstrip().startswith("|") and name is not None:
            rules[name] += " " + line.strip()
            continue
        found = re.fullmatch(r"\s*[?!]?([A-Za-z_][A-Za-z_0-9]*)\s*:(.*)", line)
        if found is None:
            return None
        name, body = found.groups()
        rules[name] = body.strip()
    expanding: List[str] = []

    def rule(rule_name: str) -> Optional[str]:
        if rule_name in LARK_COMMON and rule_name not in rules:
            return LARK_COMMON[rule_name]
        if rule_name not in rules or rule_name in expanding:
            return None
        expanding.append(rule_name)
        body = re.sub(r"->\s*\w+", "", rules[rule_name])  # (an alias names a tree node: nothing to match)
        tokens = []
        at = 0
        while body[at:].strip():
            token = _LARK_TOKEN.match(body, at)
            if token is None:
                return None
            tokens.append((token.lastgroup, token.group(token.lastgroup)))
            at = token.end()
        pattern = _lark_alternatives(tokens, rule)
        expanding.pop()
        return pattern

    return rule("start")


def _lark_alternatives(tokens: List[tuple], rule) -> Optional[str]:
    """Lark's expansion ``tokens`` (kind, text) as one regular expression, rules expanded by
    ``rule``; None where a part cannot be."""
    stack: List[List[List[str]]] = [[[]]]  # per open group: its alternatives, each a sequence of patterns
    closers: List[str] = []
    for kind, text in tokens:
        alternatives = stack[-1]
        if kind == "string":
            try:
                literal = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                return None
            alternatives[-1].append(re.sub(r"([\\.^$|?*+()\[\]{}-])", r"\\\1", literal).replace("\n", r"\n"))
        elif kind == "regex":
            alternatives[-1].append("(?:" + text[1:-1].replace("\\/", "/") + ")")
        elif kind == "name":
            expanded = rule(text)
            if expanded is None:
                return None
            alternatives[-1].append("(?:" + expanded + ")")
        elif text in "([":
            stack.append([[]])
            closers.append(")" if text == "(" else "]")
        elif text in ")]":
            if not closers or closers.pop() != text:
                return None
            group = stack.pop()
            stack[-1][-1].append("(?:" + "|".join("".join(seq) for seq in group) + ")" + ("?" if text == "]" else ""))
        elif text == "|":
            alternatives.append([])
        elif not alternatives[-1]:  # an operator with nothing before it
            return None
        else:
            alternatives[-1][-1] = "(?:" + alternatives[-1][-1] + ")" + text
    if closers:
        return None
    return "|".join("".join(sequence) for sequence in stack[0])


def calls_grammar(functions: Sequence[str], held: Mapping[str, str], named: Optional[str] = None) -> Dict[str, str]:
    """The reply's grammar (a response format) where some tools' text is held (``held``: a
    freeform tool's name -> the regular expression its text follows), for models that write
    calls as ``<tool_call>`` JSON (Qwen, Hermes): free text, then calls if any, each a JSON
    object naming a tool; a held tool's ``input`` string follows its expression, the other
    tools' arguments are any object. ``named``: the reply was made to begin with that held
    tool's call up to its arguments' ``{`` (forced_opening): the grammar is the call's rest."""
    def call(name: str, arguments: Dict[str, Any]) -> Dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"], "additionalProperties": False}

    text = {name: {"type": "string", "pattern": f"^(?:{pattern})$"} for name, pattern in held.items()}
    if named is not None:
        return {"type": "grammar", "syntax": "lark", "definition":
                f'start: "\\"input\\": " %json {json.dumps(text[named])} "}}}}\\n" </tool_call>\n'}
    arguments = {name: {"type": "object", "properties": {"input": string}, "required": ["input"],
                        "additionalProperties": False} for name, string in text.items()}
    schema = {"anyOf": [call(name, arguments.get(name, {"type": "object"})) for name in functions],
              "x-guidance": JSON_LAYOUT}
    return {"type": "grammar", "syntax": "lark", "definition":
            "start: TEXT | TEXT? calls\ncalls: call (\"\\n\" call)*\n"
            "call: <tool_call> \"\\n\" body \"\\n\" </tool_call>\n"
            f"body: %json {json.dumps(schema)}\nTEXT: /(.|\\n)+/\n"}


def schema_grammar(schema: Any, where: str = "the JSON schema") -> str:
    """llguidance's grammar for a JSON schema (a dict, or its JSON text), checked with the
    engine: a schema it cannot follow gets one line naming what is wrong."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise _field_error(f"{where} is not JSON ({exc})", where) from None
    if not isinstance(schema, (dict, bool)):
        raise _field_error(f"{where} must be a JSON schema object", where)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise _field_error(f"{where} is not a valid JSON schema: {exc}", where) from None
    return _followable(grammar, where, where)


def _followable(grammar: str, what: str, where: str) -> str:
    """``grammar``, once the engine has checked it can follow it (one line naming ``what`` if not)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise _field_error(f"{what} cannot be followed: {_first_line(messages[0])}", where)
    return grammar


def schema_file_format(name: str) -> dict:
    """The response format holding a reply to the JSON schema in file ``name``
    (``generate --json-schema``), checked: one line says what is wrong."""
    if not Path(name).expanduser().exists():
        raise UserError(f"JSON schema file {name} does not exist")
    try:
        schema = read_json(Path(name).expanduser())
    except ValueError as problem:
        raise UserError(f"JSON schema file {name}: {problem}; give a JSON schema such as "
                        '{"type": "object", "properties": {...}}') from None
    schema_grammar(schema, f"JSON schema file {name}")
    return {"type": "json_schema", "json_schema": {"name": Path(name).stem, "schema": schema}}


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "the grammar engine refused it"


def _field_error(message: str, where: str) -> UserError:
    return UserError(message, where.split(".")[0])  # (the server names the request's field)


@lru_cache(maxsize=4)
def _engine_tokenizer(tokenizer, vocab: int) -> "llguidance.LLTokenizer":
    """llguidance's view of ``tokenizer`` (an mlx-lm TokenizerWrapper over a fast Hugging Face
    tokenizer), built from the tokenizers library's own description of it: about a second,
    so kept."""
    backend = copy.copy(getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None))
    if backend is None:
        raise UserError("structured outputs need a fast (Hugging Face tokenizers) tokenizer; this model's is not one")
    backend.no_padding()
    backend.no_truncation()
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=sorted(tokenizer.eos_token_ids))
    except ValueError as exc:
        raise UserError(f"structured outputs cannot read this model's tokenizer: {exc}") from None


@dataclass
class Shaped:
    """A round's tree after the grammar: the drafter's kept nodes, then the forced ones."""

    tree: DraftTree
    tokens: mx.array  # [nodes] int32
    placed: List[Optional[int]]  # per node of the drafter's proposal: its index here (None: cut)
    allowed: Optional[mx.array]  # [1 + nodes, vocab words] uint32: the root's row's mask, then each node's (None: all)
    forced_from: int  # the first node the grammar forced (they come after the drafter's)

    def drafters_path(self, path: List[int]) -> List[int]:
        """The drafter's own nodes among the accepted ``path``."""
        accepted = set(path)
        return [own for own, node in enumerate(self.placed) if node in accepted]


class Grammar:
    """One reply's grammar state: what its committed tokens have matched so far."""

    forced_source = "grammar (forced tokens)"  # the name of the tokens it forces, in statistics

    def __init__(self, tokenizer, grammar: str, vocab: int):
        self.vocab = vocab
        self.matcher = llguidance.LLMatcher(_engine_tokenizer(tokenizer, vocab), grammar)
        if self.matcher.is_error():
            raise UserError(f"the grammar cannot be followed: {_first_line(self.matcher.get_error())}")
        self.words = (vocab + 31) // 32
        self.forced = SourceStats()  # the forced tokens drafted in this reply, and how many were accepted

    def _mask(self, rows: np.ndarray, row: int) -> None:
        """The allowed tokens at the matcher's state into ``rows[row]``. Where the grammar has
        ended (the engine says "stopped" as soon as nothing but the end can follow, before an
        end of sequence is taken), that is the end of sequence alone: the reply ends with
        the value, never runs on as prose."""
        self.matcher.unsafe_compute_mask_ptr(rows[row].ctypes.data, rows[row].nbytes)

    def binds(self, room: int) -> bool:
        """Whether a round whose rows lie up to ``room`` tokens ahead is shaped: always (every
        token is the grammar's)."""
        return True

    def mask_now(self) -> mx.array:
        """[1, words]: the allowed tokens after what was committed."""
        rows = np.zeros((1, self.words), dtype=np.int32)
        self._mask(rows, 0)
        return mx.array(rows.view(np.uint32))

    def commit(self, tokens: Sequence[int], shaped: Optional[Shaped] = None, path: Sequence[int] = ()) -> None:
        """Tokens the reply now holds (each one the mask allowed); after a round, the
        ``shaped`` tree it verified and the nodes of it accepted (``path``)."""
        if shaped is not None:
            self.forced.proposed += len(shaped.tree) - shaped.forced_from
            self.forced.accepted += sum(1 for node in path if node >= shaped.forced_from)
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(token)):
                raise RuntimeError(f"the grammar refused committed token {token}: {self.matcher.get_error()}")

    def shape(self, tokens: Sequence[int], parents: Sequence[int], room: int, nodes: int) -> Shaped:
        """The tree the target verifies this round, from a drafter's (``tokens``, ``parents``;
        none for an empty one), in the drafter's node order: see the module's docstring.
        ``room``: how deep a node may be; ``nodes``: how many the tree may hold."""
        rows = np.zeros((1 + len(tokens) + MAX_FORCED, self.words), dtype=np.int32)
        self._mask(rows, 0)
        tree, placed = DraftTree(), []
        path: List[int] = []  # the tokens the matcher holds past the root: the path to the last node visited
        stopped = [self.matcher.is_stopped()]  # per row: the grammar has ended there
        for token, parent in zip(tokens, parents):
            at = placed[parent] if parent >= 0 else -1
            if (parent >= 0 and at is None) or stopped[at + 1] or not _allowed(rows[at + 1], token):
                placed.append(None)
                continue
            self._walk_to(path, tree.tokens, tree.parents, at)
            if self.matcher.try_consume_tokens([token]) != 1:
                placed.append(None)
                continue
            node = tree.add(token, at)
            path.append(token)
            placed.append(node)
            self._mask(rows, node + 1)
            stopped.append(self.matcher.is_stopped())
        forced_from, best = len(tree), -1
        children = tree.children()
        while children.get(best):
            best = children[best][0]
        self._walk_to(path, tree.tokens, tree.parents, best)
        if not stopped[best + 1]:
            depth = tree.depths[best] if best >= 0 else 0
            forced = self.matcher.compute_ff_tokens()[:max(0, min(room - depth, nodes - len(tree), MAX_FORCED))]
            for token in forced:
                if self.matcher.try_consume_tokens([token]) != 1:
                    break
                best = tree.add(token, best)
                path.append(token)
                self._mask(rows, best + 1)
        self.matcher.rollback(len(path))
        return Shaped(tree, mx.array(tree.tokens, dtype=mx.int32), placed,
                      mx.array(rows[:len(tree) + 1].view(np.uint32)), forced_from)

    def _walk_to(self, path: List[int], tokens: List[int], parents: List[int], node: int) -> None:
        """Bring the matcher from ``path`` (the tokens it holds past the root) to ``node``'s
        path, rolling back to where they part and consuming the rest."""
        target: List[int] = []
        while node >= 0:
            target.append(tokens[node])
            node = parents[node]
        target.reverse()
        shared = 0
        while shared < min(len(path), len(target)) and path[shared] == target[shared]:
            shared += 1
        if len(path) > shared:
            self.matcher.rollback(len(path) - shared)
        if self.matcher.try_consume_tokens(target[shared:]) != len(target) - shared:
            raise RuntimeError(f"the grammar refused a path it allowed: {self.matcher.get_error()}")
        path[:] = target


def _allowed(row: np.ndarray, token: int) -> bool:
    return 0 <= token < row.size * 32 and bool((int(row[token >> 5]) >> (token & 31)) & 1)


def mask_logits(logits: mx.array, allowed: mx.array) -> mx.array:
    """``logits`` [rows, vocab] with every token a row's mask (``allowed`` [rows, words]
    uint32 bits) leaves out set to -inf."""
    bits = (allowed[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    bits = bits.reshape(allowed.shape[0], -1)
    vocab = logits.shape[-1]
    if bits.shape[1] < vocab:
        bits = mx.concatenate([bits, mx.zeros((bits.shape[0], vocab - bits.shape[1]), dtype=bits.dtype)], axis=1)
    return mx.where(bits[:, :vocab].astype(mx.bool_), logits, mx.array(-float("inf"), dtype=logits.dtype))


def grammar_for(tokenizer, vocab: int, response_format: Any) -> Optional[Grammar]:
    """A fresh grammar state for one reply (None: plain text)."""
    grammar = response_grammar(response_format)
    return Grammar(tokenizer, grammar, vocab) if grammar is not None else None
