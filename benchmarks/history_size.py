"""What the history of earlier replies costs: memory for 10,000 replies, the time an update
takes per committed token, and a lookup's time (drafters/history.py).

    python benchmarks/history_size.py [--replies 10000] [--out benchmarks/results/history-size.json]

Replies of 150 tokens drawn from a Zipf distribution over SmolLM2's 49,152-token
vocabulary (text's token frequencies are about Zipfian), half of each reply copied from an
earlier one (the repetition the history is for); memory is what tracemalloc counts for the
history object's arrays and index.
"""

import argparse
import json
import time
import tracemalloc
from pathlib import Path

import numpy as np
from typing import List, Optional

from mlx_eagle.drafters.history import History


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=10_000)
    parser.add_argument("--length", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "history-size.json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    replies = []
    for number in range(args.replies):
        fresh = (rng.zipf(1.2, size=args.length) % 49152).astype(np.int32)
        if number and number % 2 == 0:  # half of it copied from an earlier reply
            earlier = replies[rng.integers(0, number)]
            fresh[: args.length // 2] = earlier[: args.length // 2]
        replies.append(fresh)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    history = History(max_tokens=args.replies * args.length)
    tic = time.perf_counter()
    for reply in replies:
        history.add(reply)
    seconds = time.perf_counter() - tic
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    contexts = [replies[i][: args.length // 2 + 3].tolist() for i in rng.integers(0, args.replies, 200)]
    tic = time.perf_counter()
    for context in contexts:
        history.match(context, 32, 16)
    lookup_ms = 1000 * (time.perf_counter() - tic) / len(contexts)
    result = {"replies": args.replies, "tokens": int(history.held), "bytes": int(size),
              "bytes_per_token": size / history.held, "update_us_per_token": 1e6 * seconds / history.held,
              "lookup_ms": lookup_ms, "index_windows": len(history.index)}
    print(f"{args.replies} replies, {history.held:,} tokens: {size / 1e6:.0f} MB ({size / history.held:.0f} bytes a "
          f"token); an update {result['update_us_per_token']:.1f} us a token; a lookup {lookup_ms:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
