"""The phase breakdown of results/round_overhead.py for the decoder before device-side
rounds (commit 305e591), whose methods it calls: run it from a checkout of that commit.

    git worktree add /tmp/before 305e591 && cd /tmp/before
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python /path/to/round_phases_before.py OUT.json
"""

import json
import statistics
import sys
import time

import mlx.core as mx
from mlx_eagle import load
from mlx_eagle.decoder import SpeculativeDecoder
from mlx_eagle.target import keep_cache_entries, tree_mask
from mlx_eagle.trees import parse_tree
from mlx_eagle.verify import Sampling, accept

model, tokenizer, head = load(draft="auto")
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a hash map works."}], add_generation_prompt=True)
result = {}
for tree_text in ("chain:1", "chain:4", "static:default"):
    d = SpeculativeDecoder(model, head, parse_tree(tree_text), Sampling())
    d.prefill(prompt)
    spent = {k: [] for k in ("draft", "verify", "accept", "host")}
    produced = 0
    for _ in range(40):
        tic = time.perf_counter()
        tree = d._draft(64)
        mx.eval(d.draft_cache[0].keys)
        drafted = time.perf_counter()
        start = d.cache[0].offset
        tokens = [d.root] + tree.tokens
        if tree.is_chain():
            out = d._forward(tokens, start, "causal" if len(tokens) > 1 else None)
        else:
            positions = mx.array([start] + [start + x for x in tree.depths])
            out = d._forward(tokens, positions, tree_mask(start, mx.array(tree.ancestor_matrix())))
        mx.eval(out.logits, out.features)
        verified = time.perf_counter()
        path, bonus = accept(tree, out.logits, d.sampling, d.rng)
        accepted_t = time.perf_counter()
        kept = [0] + [n + 1 for n in path]
        keep_cache_entries(d.cache, start, kept)
        d._set_pending(out.features[mx.array(kept)], [tree.tokens[n] for n in path] + [bonus])
        d.root = bonus
        mx.eval(d.pending)
        done = time.perf_counter()
        produced += len(path) + 1
        spent["draft"].append(drafted - tic)
        spent["verify"].append(verified - drafted)
        spent["accept"].append(accepted_t - verified)
        spent["host"].append(done - accepted_t)
    row = {k: 1000 * statistics.mean(v[2:]) for k, v in spent.items()}
    row["round"] = sum(row.values())
    row["tokens_per_round"] = produced / 40
    result[tree_text] = row
    print(tree_text, {k: round(v, 2) for k, v in row.items()})
json.dump(result, open(sys.argv[1], "w"), indent=1)
