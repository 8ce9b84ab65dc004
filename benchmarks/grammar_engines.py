"""Which grammar engine masks structured outputs: llguidance, xgrammar and outlines-core,
on Qwen2.5-Coder-0.5B-Instruct's tokenizer (152k tokens), measured on this CPU.

For each JSON schema: the time to build a matcher (tokenizer tables and schema), then,
walking a valid document token by token, the time to compute each position's allowed-token
bitmask and to consume the token; and whether the engine gives the tokens the grammar
forces (what a round drafts for free). A speculative round needs a mask at every node of its
tree, so the per-mask time is what counts most, beside rolling back along the tree.

    python benchmarks/grammar_engines.py --out benchmarks/results/grammar-engines.json

An engine that is not installed is reported as such (xgrammar needs torch, outlines-core a
vocabulary the Hub or the caller builds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "tags": ["mathematician", "writer", "analyst"]}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"enum": ["read_file", "search_code", "run_tests"]},
        "arguments": {"type": "object", "properties": {
            "path": {"type": "string"}, "pattern": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["path"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "search_code", "arguments": {"path": "src/server.py", "pattern": "def handle_", "max_results": 20}}),
}


def walk(make: Callable[[], object], mask: Callable[[object], None], consume: Callable[[object, int], bool],
         tokens: List[int]) -> Dict[str, float]:
    tic = time.perf_counter()
    matcher = make()
    build = time.perf_counter() - tic
    masks, consumes = [], []
    for token in tokens:
        tic = time.perf_counter()
        mask(matcher)
        masks.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        if not consume(matcher, token):
            raise RuntimeError(f"the engine refused token {token} of a valid document")
        consumes.append(time.perf_counter() - tic)
    return {"build_ms": 1e3 * build, "mask_ms_mean": 1e3 * statistics.mean(masks),
            "mask_ms_p90": 1e3 * sorted(masks)[int(0.9 * len(masks))],
            "consume_ms_mean": 1e3 * statistics.mean(consumes)}


def llguidance_engine(hf_tokenizer, vocab: int):
    import llguidance
    import llguidance.hf

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
    words = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def make(schema):
        return lambda: llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema))

    def mask(matcher):
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    return make, mask, lambda matcher, token: matcher.consume_token(token), True


def xgrammar_engine(hf_tokenizer, vocab: int):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def make(schema):
        return lambda: xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), strict_mode=True))

    return make, lambda matcher: matcher.fill_next_token_bitmask(bitmask), \
        lambda matcher, token: matcher.accept_token(token), False  # (jump-forward: a string, not tokens)


def outlines_engine(hf_tokenizer, vocab: int):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = hf_tokenizer.eos_token_id
    byte_of = {ch: bytes([b]) for b, ch in _gpt2_bytes().items()}
    table: Dict[bytes, List[int]] = {}
    for text, token in hf_tokenizer.get_vocab().items():
        if token != eos and token not in hf_tokenizer.all_special_ids:
            table.setdefault(b"".join(byte_of.get(ch, ch.encode()) for ch in text), []).append(token)
    vocabulary = Vocabulary(eos, table)
    words = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def make(schema):
        return lambda: Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))

    def consume(guide, token):
        guide.advance(token)
        return True

    return make, lambda guide: guide.write_mask_into(words.ctypes.data, words.size, 4), consume, False


def _gpt2_bytes() -> Dict[int, str]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in in BPE vocabularies."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_engine}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF or model directory (default: Qwen2.5-Coder-0.5B)")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    import subprocess
    import sys

    from mlx_eagle import load

    model_path = args.model or subprocess.run(
        [sys.executable, str(Path(__file__).parent / "qwen_models.py"), "0.5b"],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    model, tokenizer = load(model_path)
    vocab = model.args.vocab_size
    hf_tokenizer = tokenizer._tokenizer
    results: Dict[str, Dict] = {}
    for name, engine in ENGINES.items():
        try:
            tic = time.perf_counter()
            make, mask, consume, forced = engine(hf_tokenizer, vocab)
            setup = time.perf_counter() - tic
        except Exception as exc:  # an engine that cannot be set up here is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            print(f"{name}: {results[name]['error']}")
            continue
        results[name] = {"tokenizer_setup_ms": 1e3 * setup, "forced_tokens": forced, "schemas": {}}
        for schema_name, (schema, document) in SCHEMAS.items():
            tokens = hf_tokenizer.encode(json.dumps(document), add_special_tokens=False)
            try:
                row = walk(make(schema), mask, consume, tokens)
            except Exception as exc:
                row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            results[name]["schemas"][schema_name] = row
            print(f"{name:14s} {schema_name:10s} " + "  ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"model": str(model_path), "vocab": vocab, "engines": results},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
