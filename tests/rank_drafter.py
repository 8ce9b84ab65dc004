"""A drafter that drafts differently on each rank of a sharded model, as a rank's own
history file or timings could make it: rank 0 drafts the target's continuation with
planned mistakes (oracle.ScriptedDrafter, from the token ids in the JSON file
MLX_EAGLE_TEST_SCRIPT names, prompt included), the other ranks propose chains of their own.
Named on command lines as ``rank_drafter:RankDrafter``.

With MLX_EAGLE_TEST_FAULT=exit (or hang), rank 1 dies (or stops answering) in its fourth round."""

import json
import os
import time

from mlx_eagle import Drafter, Proposal
from mlx_eagle.distributed import rank

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
