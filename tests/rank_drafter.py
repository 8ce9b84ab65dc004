"""Drafters that draft differently on each rank of a sharded model, as a rank's own
history file or timings could make it: rank 0 drafts the target's continuation with
planned mistakes (oracle.ScriptedDrafter, from the token ids in the JSON file
MLX_EAGLE_TEST_SCRIPT names, prompt included), the other ranks propose chains of their own.
Named on command lines as ``rank_drafter:RankDrafter``.

With MLX_EAGLE_TEST_FAULT=exit (or hang), rank 1 dies (or stops answering) in its fourth round."""

import json
import os
import time

import mlx.core as mx

from mlx_eagle import Drafter, Proposal
from mlx_eagle.distributed import rank
from mlx_eagle.trees import DraftTree

from oracle import ScriptedDrafter


class RankDrafter(Drafter):
    def __init__(self):
        script = os.environ.get("MLX_EAGLE_TEST_SCRIPT")
        self.scripted = ScriptedDrafter(json.loads(open(script).read()) if script else [], vocab_size=1)
        self.rounds = 0

    def observe(self, outcome):
        self.scripted.observe(outcome)

    def propose(self, budget):
        self.rounds += 1
        fault = os.environ.get("MLX_EAGLE_TEST_FAULT")
        if rank() == 1 and self.rounds == 4 and fault == "exit":
            os._exit(3)
        if rank() == 1 and self.rounds == 4 and fault == "hang":
            time.sleep(3600)
        self.scripted.vocab_size = budget.vocab or 1
        if rank() == 0:
            return self.scripted.propose(budget)
        if budget.room < 1:
            return None
        vocab = budget.vocab or 100
        return Proposal.chain([(self.rounds * 7 + i * rank()) % vocab for i in range(min(3, budget.room))])


class RankTreeDrafter(Drafter):
    """Rank 0 drafts two tokens after the root, whatever the context (the ids in the JSON
    list MLX_EAGLE_TEST_TREE); the other ranks draft the second alone."""

    def __init__(self):
        self.tokens = json.loads(os.environ["MLX_EAGLE_TEST_TREE"])

    def observe(self, outcome):
        pass

    def propose(self, budget):
        if budget.room < 1:
            return None
        if rank() != 0:
            return Proposal.chain(self.tokens[1:])
        return Proposal(DraftTree(list(self.tokens), [-1, -1], [1, 1]), mx.array(self.tokens, dtype=mx.int32))
