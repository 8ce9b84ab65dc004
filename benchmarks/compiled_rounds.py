"""SmolLM2 end to end with the default drafting (the shipped head and context lookup, no
earlier replies), compiled rounds (the static draft one compiled call across depths, the
verify pass one compiled call per bucket of block sizes) against eager ones (drafted depth
by depth, verified layer by layer): the same prompts, alternating compiled, eager, eager,
compiled after one untimed warm-up, time from the request to the last token.

    python benchmarks/compiled_rounds.py [--limit 10] [--max-tokens 64] [--out benchmarks/results/compiled-rounds.json]
"""

import argparse
import json
import time
from pathlib import Path

from mlx_eagle import load, plan_drafts, stream_generate
from mlx_eagle.compiled import compiling_rounds
from mlx_eagle.bench import mtbench_suite, read_prompts
from mlx_eagle.cli import use_fast_blas

HERE = Path(__file__).resolve().parent


def measure(model, tokenizer, head, texts, max_tokens: int) -> dict:
    seconds, taus, identical = {True: 0.0, False: 0.0}, {True: [], False: []}, True
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        outputs = set()
        for compiled in (None, True, False, False, True):  # None: the warm-up
            with compiling_rounds(bool(compiled)):
                plan = plan_drafts(model, head, "auto", history=False)
                tic = time.perf_counter()
                responses = list(stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft=plan))
            if compiled is not None:
                seconds[compiled] += time.perf_counter() - tic
                taus[compiled].append(responses[-1].tokens_per_forward)
            outputs.add(tuple(r.token for r in responses))
        identical &= len(outputs) == 1
    return {"compiled_s": seconds[True], "eager_s": seconds[False], "compiled_vs_eager": seconds[True] / seconds[False],
            "tau_compiled": sum(taus[True]) / len(taus[True]), "tau_eager": sum(taus[False]) / len(taus[False]),
            "identical": identical}


def main() -> None:
    use_fast_blas()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="prompts of each set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "compiled-rounds.json")
    args = parser.parse_args()
    model, tokenizer, head = load(draft="auto")
    sets = {"edit": [p.turns[0] for p in read_prompts(HERE / "prompts" / "edit.jsonl")][:args.limit],
            "mt-bench": [p.turns[0] for p in mtbench_suite()][:args.limit]}
    results = {}
    for name, prompts in sets.items():
        results[name] = row = measure(model, tokenizer, head, prompts, args.max_tokens)
        print(f"{name:9s} compiled {row['compiled_s']:6.1f} s  eager {row['eager_s']:6.1f} s  "
              f"compiled/eager {row['compiled_vs_eager']:.3f}  tau {row['tau_compiled']:.2f} / {row['tau_eager']:.2f}  "
              f"identical text {row['identical']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"limit": args.limit, "max_tokens": args.max_tokens, **results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
