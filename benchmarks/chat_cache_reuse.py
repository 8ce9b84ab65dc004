"""What reusing the conversation's KV cache saves: a chat of MT-bench questions (both
turns each, in one conversation) through ChatSession, then every turn's prompt read again
from an empty cache.

    python benchmarks/chat_cache_reuse.py [--questions 3] [--max-tokens 128] \
        [--out benchmarks/results/chat-cache-reuse.json]
"""

import argparse
import json
from pathlib import Path
from typing import List, Optional

from mlx_eagle.cli import use_fast_blas


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "chat-cache-reuse.json")
    args = parser.parse_args(argv)
    use_fast_blas()

    from mlx_eagle.data import mtbench_questions
    from mlx_eagle.replies import chat_tokens
    from mlx_eagle.session import ChatSession

    chat = ChatSession(args.model, draft="auto", max_tokens=args.max_tokens)
    turns = [turn for question in mtbench_questions()[:args.questions] for turn in question["turns"]]
    rows, prompts = [], []
    for number, turn in enumerate(turns, 1):
        list(chat.send(turn))
        prompts.append(chat_tokens(chat.engine.tokenizer, chat.messages()[:-1]))
        stats = chat.stats
        rows.append({"turn": number, "prompt_tokens": stats.prompt_tokens, "cached": stats.prompt_reused,
                     "read": stats.prompt_tokens - stats.prompt_reused, "seconds_with_cache": stats.prompt_seconds})
    for row, ids in zip(rows, prompts):
        chat.engine.reset_cache()
        last = list(chat.engine.generate(ids, max_tokens=1))[-1]
        row["seconds_from_scratch"] = len(ids) / last.prompt_tps
    chat.engine.close()

    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'read':>5} {'with cache':>11} {'from scratch':>13}")
    for row in rows:
        print(f"{row['turn']:>4} {row['prompt_tokens']:>7} {row['cached']:>7} {row['read']:>5} "
              f"{row['seconds_with_cache']:>10.2f}s {row['seconds_from_scratch']:>12.2f}s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
