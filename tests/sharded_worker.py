"""One rank of a sharded generation, started by mlx.launch from test_distributed.py: the
target loaded by mlx_eagle.load (mlx-lm's sharded_load underneath), then plain mlx-lm
generation and mlx_eagle's with each drafter asked for, every rank writing its tokens.

    mlx.launch -n 2 python tests/sharded_worker.py MODEL_DIR OUT_DIR PROMPT MAX_TOKENS DRAFT[,DRAFT...] [TEMP SEED]

DRAFT: "none", "lookup", "auto", a head's directory, or "DIR@tree" for a head with a --tree spec.
MODEL_DIR may hold "{rank}": each rank then loads its own (a load that must fail).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.generate import generation_stream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_eagle import load, stream_generate  # noqa: E402
from mlx_eagle.distributed import sharding, world  # noqa: E402
from mlx_eagle.errors import UserError  # noqa: E402


def main(model_dir: str, out: str, prompt: str, max_tokens: str, drafts: str, temp: str = "0", seed: str = "0") -> None:
    group = world()
    try:
        model, tokenizer = load(model_dir.format(rank=group.rank()))
    except UserError as error:  # (the commands print it as one line)
        (Path(out) / f"rank{group.rank()}-of-{group.size()}.json").write_text(json.dumps({"error": str(error)}))
        return
    ids = tokenizer.encode(prompt)
    results = {"sharding": sharding(model)}
    if float(temp) == 0:
        results["mlx_lm"] = [r.token for r in mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=int(max_tokens))]
        # mlx-lm computes a step ahead on a stream of its own: its collectives finish before
        # any other stream's start, or the ranks could pair one stream's with the other's.
        mx.synchronize(generation_stream)
    for draft in drafts.split(","):
        head, _, tree = draft.partition("@")
        responses = list(stream_generate(model, tokenizer, ids, max_tokens=int(max_tokens), draft=head,
                                         tree=tree or None, temp=float(temp), seed=int(seed), history=False))
        results[draft] = {"tokens": [r.token for r in responses], "tau": responses[-1].tokens_per_forward}
    (Path(out) / f"rank{group.rank()}-of-{group.size()}.json").write_text(json.dumps(results))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # every rank done before any leaves


if __name__ == "__main__":
    main(*sys.argv[1:])
