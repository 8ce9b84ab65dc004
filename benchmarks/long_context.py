"""Speculation over long contexts, with and without quantized KV caches: plain mlx-lm, ours
with ``--draft none`` and ours with default drafting, alternating per prompt, at prompts of
about 512, 2k and 8k tokens (SmolLM2 to its 8k context; Qwen2.5-Coder-0.5B with ``--model``
for 16k and 32k).

    python benchmarks/long_context.py [--model M] [--lengths 512,2048,8192] [--kv none,8,4]
        [--max-tokens 96] [--out benchmarks/results/long-context.json]

Two tasks per length, over this repository's own documentation cut to the length: rewrite
the document's last paragraph fixing typos (a reply that copies the context), and an open
question about it. Each (length, cache) pair is one ``python -m mlx_eagle.bench`` run, so the
three methods alternate under the same machine load; quantized caches start at once
(``--quantized-kv-start 0``; mlx-lm's default, 5000, would leave the shorter prompts
unquantized). This device's costs, at a short and a 2k context, are timed first and kept,
so that no measured reply pays for timing them. Reported per pair: speedup and τ of default
drafting over plain mlx-lm, ours with ``--draft none``, whether the text is identical, peak
memory and MLX's buffer cache after each request, per method.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
TASKS = {
    "rewrite": "Rewrite the last paragraph of the document above, fixing any typos. Reply with the paragraph only.",
    "question": "What are the three most important things the document above says? Answer in a few sentences.",
}


def document() -> str:
    """README and docs, paragraph by paragraph: tens of thousands of tokens of real text."""
    parts = [(ROOT / "README.md").read_text()] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(parts)


def cut(text: str, tokenizer, tokens: int) -> str:
    """The first ``tokens`` tokens of ``text``, ended at a paragraph's end where one lies in
    their last tenth."""
    ids = tokenizer.encode(text)
    if len(ids) < tokens:
        raise SystemExit(f"error: the documentation holds only {len(ids)} tokens; cannot build a {tokens}-token prompt")
    head = tokenizer.decode(ids[:tokens])
    end = head.rfind("\n\n")
    return head[:end] if end >= 0.9 * len(head) else head


def prompts_file(tokenizer, length: int, directory: Path) -> Path:
    text = document()
    while len(tokenizer.encode(text)) < length * 1.2:  # a 32k prompt needs the documentation more than once
        text = text + "\n\n" + document()
    body = cut(text, tokenizer, length - 60)
    path = directory / f"long-{length}.jsonl"
    path.write_text("".join(json.dumps({"id": f"{task}-{length}", "category": task, "messages": [
        {"role": "user", "content": f"{body}\n\n{question}"}]}) + "\n" for task, question in TASKS.items()))
    return path


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="as --model takes it (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--kv", default="none,8,4", help="cache settings: none (unquantized) or bits")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long-context.json")
    args = parser.parse_args(argv)
    from mlx_eagle import load
    from mlx_eagle.costs import CALIBRATION_CONTEXT, verify_costs

    model, tokenizer = load(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) > 2 * CALIBRATION_CONTEXT:  # (shorter replies attend to about what the near curve was timed at)
        verify_costs(model).measure_long()  # timed now, once, and kept: never inside a measured reply
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for length in lengths:
            prompts = prompts_file(tokenizer, length, Path(scratch))
            for kv in args.kv.split(","):
                out = Path(scratch) / f"bench-{length}-{kv}.json"
                command = [sys.executable, "-m", "mlx_eagle.bench", "--prompts", str(prompts), "--quiet",
                           "--methods", "baseline,none,default", "--max-tokens", str(args.max_tokens),
                           "--out", str(out)]
                command += ["--model", args.model] if args.model else []
                command += ["--kv-bits", kv, "--quantized-kv-start", "0"] if kv != "none" else []
                print(f"{length} tokens, cache {kv}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
                subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                result = json.loads(out.read_text())
                methods = result["methods"]
                rows.append({
                    "length": length, "kv_bits": None if kv == "none" else int(kv),
                    "prompts": [p["id"] for p in result["prompts"]["baseline"]],
                    "speedup": methods["default"]["speedup"], "decode_speedup": methods["default"]["decode_speedup"],
                    "none_speedup": methods["none"]["speedup"], "tau": methods["default"]["tau"],
                    "identical": methods["default"].get("identical"),
                    "none_identical": methods["none"].get("identical"),
                    "plain_tokens_per_s": methods["baseline"]["tokens_per_s_overall"],
                    "peak_memory_gb": {name: m["peak_memory_gb"] for name, m in methods.items()},
                    "cache_memory_gb": {name: m["cache_memory_gb"] for name, m in methods.items()},
                    "machine": result["machine"],
                })
                print(line(rows[-1]), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)  # after every pair: a long run stopped keeps them
                args.out.write_text(json.dumps({"model": args.model or "SmolLM2-135M-Instruct",
                                                "max_tokens": args.max_tokens, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


def line(row: dict) -> str:
    peak, cache = row["peak_memory_gb"], row["cache_memory_gb"]
    return (f"| {row['length']} | {row['kv_bits'] or 'none'} | {row['plain_tokens_per_s']:.1f} | "
            f"**{row['speedup']:.2f}×** (τ {row['tau']:.2f}) | {row['decode_speedup']:.2f}× | "
            f"{row['none_speedup']:.2f}× | {row['identical']} | "
            f"{peak['baseline']:.2f} / {peak['none']:.2f} / {peak['default']:.2f} | "
            f"{cache['baseline']:.2f} / {cache['none']:.2f} / {cache['default']:.2f} |")


if __name__ == "__main__":
    main()
