"""What drafting from earlier replies costs where they do not repeat: MT-bench first turns
(or a prompt file) answered in turn with and without the history, methods alternating
prompt by prompt, the history built up from the earlier answers as in use. Counts the
rounds, the nodes verified a round and the seconds each takes; the text must be the same.

    python benchmarks/history_overhead.py [--limit 8] [--max-tokens 128] [--out FILE.json]
"""

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional

from mlx_eagle.cli import use_fast_blas

HERE = Path(__file__).resolve().parent


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8, help="MT-bench first turns")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "history-overhead.json")
    args = parser.parse_args(argv)
    use_fast_blas()
    from mlx_eagle import load, stream_generate
    from mlx_eagle.data import mtbench_questions
    from mlx_eagle.decoder import SpeculativeDecoder
    from mlx_eagle.drafters.history import History
    from mlx_eagle.replies import chat_tokens

    model, tokenizer = load()
    counts = {name: {"rounds": 0, "nodes": 0, "seconds": 0.0} for name in ("history", "no history")}
    current = []
    round_of = SpeculativeDecoder.round

    def counted(self, *rest, **options):
        result = round_of(self, *rest, **options)
        counts[current[0]]["rounds"] += 1
        counts[current[0]]["nodes"] += result.drafted
        return result

    SpeculativeDecoder.round = counted
    history, texts = History(), {}
    for index, question in enumerate(q["turns"][0] for q in mtbench_questions()[:args.limit]):
        ids = chat_tokens(tokenizer, [{"role": "user", "content": question}])
        order = [("history", history), ("no history", False)]
        for name, source in order if index % 2 else order[::-1]:
            current[:] = [name]
            tic = time.perf_counter()
            texts.setdefault(name, []).append("".join(r.text for r in stream_generate(
                model, tokenizer, ids, max_tokens=args.max_tokens, draft="auto", history=source)))
            counts[name]["seconds"] += time.perf_counter() - tic
    for name, count in counts.items():
        count["nodes_per_round"] = count["nodes"] / max(count["rounds"], 1)
        print(f"{name:10} rounds {count['rounds']:5}  nodes a round {count['nodes_per_round']:.2f}  "
              f"{count['seconds']:.1f} s")
    result = {"prompts": args.limit, "max_tokens": args.max_tokens, "methods": counts,
              "identical": texts["history"] == texts["no history"],
              "time_ratio": counts["history"]["seconds"] / counts["no history"]["seconds"]}
    print(f"history / no history time: {result['time_ratio']:.3f}, identical text: {result['identical']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
