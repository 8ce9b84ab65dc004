"""The batch's levers, one at a time turned off, so that benchmarks measure what each buys:

- ``rows``: the drafters backed by a model (heads, draft models, DFlash and DSpark) draft one
  conversation after another, not the whole batch in one pass a depth (their
  ``observe_together`` as the Drafter default);
- ``no-ride``: new prompts are read in passes of their own between the rounds, not inside
  the rounds' packed pass (``scheduler.RIDE_PROMPTS`` off);
- ``own-odds``: a new conversation's odds for the batch's choice of nodes start from
  node_odds' fixed prior, not from its plan's conversations' (``DraftPlan.odds``).

(The third, nodes chosen across rows rather than in seat order, has no switch: seat order is
gone. ``benchmarks/batch_commits.py`` compares it against the commit before.)

Run as a script, it starts our server with one lever off (what ``agent.py`` and
``concurrency.py`` start as ``ours-rows``, ``ours-no-ride`` and ``ours-own-odds``):

    python benchmarks/levers.py {rows,no-ride,own-odds} [mlx_eagle.server's arguments]
"""

import runpy
import sys
from contextlib import contextmanager
from typing import Iterator, List

LEVERS = ("rows", "no-ride", "own-odds")


@contextmanager
def lever_off(lever: str) -> Iterator[None]:
    """``lever`` (one of LEVERS) off within the block, on in this process again after it."""
    from mlx_eagle import generation, scheduler
    from mlx_eagle.drafters import Drafter
    from mlx_eagle.drafters.dflash import DFlashDrafter
    from mlx_eagle.drafters.draft_model import DraftModelDrafter
    from mlx_eagle.drafters.eagle import EagleDrafter

    if lever not in LEVERS:
        raise SystemExit(f"error: no lever {lever!r}; the levers are {', '.join(LEVERS)}")
    kinds = (EagleDrafter, DFlashDrafter, DraftModelDrafter) if lever == "rows" else ()  # (DSpark's is a DFlash)
    together = [kind.__dict__["observe_together"] for kind in kinds]
    riding, odds = scheduler.RIDE_PROMPTS, generation.NodeOdds
    for kind in kinds:
        kind.observe_together = Drafter.observe_together
    scheduler.RIDE_PROMPTS = riding and lever != "no-ride"
    if lever == "own-odds":
        generation.NodeOdds = lambda prior=None: odds()  # (what Generation makes a conversation's odds with)
    try:
        yield
    finally:
        for kind, method in zip(kinds, together):
            kind.observe_together = method
        scheduler.RIDE_PROMPTS, generation.NodeOdds = riding, odds


def run_server(arguments: List[str]) -> None:
    """mlx_eagle.server with ``arguments``, in this process (and whatever it has patched)."""
    sys.argv = ["mlx_eagle.server", *arguments]
    runpy.run_module("mlx_eagle.server", run_name="__main__", alter_sys=True)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in LEVERS:
        raise SystemExit(f"usage: python benchmarks/levers.py {{{','.join(LEVERS)}}} [mlx_eagle.server's arguments]")
    with lever_off(sys.argv[1]):
        run_server(sys.argv[2:])


if __name__ == "__main__":
    main()
