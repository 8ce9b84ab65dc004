"""What reusing the conversation's KV cache saves: a six-turn chat (three MT-bench
questions, both turns each, in one conversation) through ChatSession, then every turn's
prompt read again from an empty cache. Writes results/chat-cache-reuse.json.

    python results/chat-cache-reuse.py      (from the repository root)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_eagle.cli import use_fast_blas  # noqa: E402

use_fast_blas()

from mlx_eagle.data import mtbench_questions  # noqa: E402
from mlx_eagle.generate import chat_tokens  # noqa: E402
from mlx_eagle.session import ChatSession  # noqa: E402

chat = ChatSession(draft="auto", max_tokens=128)
turns = [turn for question in mtbench_questions()[:3] for turn in question["turns"]]
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
out = Path(__file__).with_suffix(".json")
out.write_text(json.dumps(rows, indent=1))
print(f"wrote {out}")
