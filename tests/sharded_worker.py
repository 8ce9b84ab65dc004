"""One rank of a sharded generation, started by mlx.launch from test_distributed.py: the
target loaded by mlx_eagle.load (mlx-lm's sharded_load underneath), then plain mlx-lm
generation and mlx_eagle's with each drafter asked for, every rank writing its tokens
(and the states entering every layer of the prompt).

    mlx.launch -n 2 python tests/sharded_worker.py MODEL_DIR OUT_DIR PROMPT MAX_TOKENS DRAFT[,DRAFT...]

DRAFT: "none", "lookup", "auto", a drafter's directory, "DIR@tree" for a head with a --tree
spec, "module:Class" for a drafter of your own, or "sampled:N" for N seeded samples of two tokens (sampled).
MODEL_DIR may hold "{rank}": each rank then loads its own (a load that must fail).
MLX_EAGLE_TEST_PIPELINE=1: the target pipelined by layers rather than split by heads.
MLX_EAGLE_TEST_TUNED=HEAD_DIR: each rank a cache of its own, where tune's tree for that head
says a three-token chain on rank 0 and plain decoding on the others (what two Macs' caches can hold).
"""

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.generate import generation_stream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_eagle import load, stream_generate  # noqa: E402
from mlx_eagle.drafters.calibrate import tuned_tree_file  # noqa: E402
from mlx_eagle.costs import device_key  # noqa: E402
from mlx_eagle.decoder import SpeculativeDecoder  # noqa: E402
from mlx_eagle.distributed import sharding, world  # noqa: E402
from mlx_eagle.errors import UserError  # noqa: E402
from mlx_eagle.target import layer_count, make_cache, tapped_forward  # noqa: E402
from mlx_eagle.verify import Sampling  # noqa: E402


def sampled(model, ids, samples: int) -> dict:
    """``samples`` seeded decodes (seeds 0, 1, ...) at temperature 1 and top-k 3 of two
    tokens, the second from a round drafting with rank_drafter.RankTreeDrafter: each
    decode's two tokens, and how many decodes accepted a draft."""
    from rank_drafter import RankTreeDrafter

    decodes, accepted = [], 0
    for seed in range(samples):
        decoder = SpeculativeDecoder(model, RankTreeDrafter(), Sampling(temp=1.0, top_k=3), seed=seed)
        first = decoder.prefill(ids)
        committed = decoder.round(2).tokens
        decodes.append([first, committed[0]])
        accepted += len(committed) > 1
    return {"tokens": decodes, "accepted": accepted}


def main(model_dir: str, out: str, prompt: str, max_tokens: str, drafts: str) -> None:
    group = world()
    try:
        model, tokenizer = load(model_dir.format(rank=group.rank()),
                                pipeline=bool(os.environ.get("MLX_EAGLE_TEST_PIPELINE")))
    except UserError as error:  # (the commands print it as one line)
        (Path(out) / f"rank{group.rank()}-of-{group.size()}.json").write_text(json.dumps({"error": str(error)}))
        return
    if os.environ.get("MLX_EAGLE_TEST_TUNED"):
        os.environ["MLX_EAGLE_CACHE"] = str(Path(out) / f"cache-rank{group.rank()}")
        tuned = tuned_tree_file(Path(os.environ["MLX_EAGLE_TEST_TUNED"]), device_key(model))
        tuned.parent.mkdir(parents=True)
        tuned.write_text(json.dumps({"paths": [[0], [0, 0], [0, 0, 0]] if group.rank() == 0 else []}))
    ids = tokenizer.encode(prompt)
    # The states entering every layer, as a drafter reading taps gets them here.
    states = tapped_forward(model, mx.array([ids]), make_cache(model), range(layer_count(model))).features
    results = {"sharding": sharding(model), "states": states[0].tolist()}
    results["mlx_lm"] = [r.token for r in mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=int(max_tokens))]
    # mlx-lm computes a step ahead on a stream of its own: its collectives finish before
    # any other stream's start, or the ranks could pair one stream's with the other's.
    mx.synchronize(generation_stream)
    for draft in drafts.split(","):
        if draft.startswith("sampled:"):
            results[draft] = sampled(model, ids, int(draft.split(":")[1]))
            continue
        head, _, tree = draft.partition("@")
        responses = list(stream_generate(model, tokenizer, ids, max_tokens=int(max_tokens), draft=head,
                                         tree=tree or None, history=False))
        results[draft] = {"tokens": [r.token for r in responses], "tau": responses[-1].tokens_per_forward}
    (Path(out) / f"rank{group.rank()}-of-{group.size()}.json").write_text(json.dumps(results))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # every rank done before any leaves


if __name__ == "__main__":
    main(*sys.argv[1:])
