"""Collect the held-out acceptance of training runs (one lever changed per run, the same
schedule: each run's --work directory with its eval.json and log.jsonl) into
benchmarks/results/train-ablations.json and print a table.

    python benchmarks/train_ablations.py RUNS_DIR [OUT]
"""
import json
import sys
from pathlib import Path

runs = Path(sys.argv[1])
out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).parent / "results" / "train-ablations.json"
table = {}
for evaluation in sorted(runs.glob("*.work/eval.json")):
    name = evaluation.parent.name[: -len(".work")]
    result = json.loads(evaluation.read_text())
    log = [json.loads(line) for line in (evaluation.parent / "log.jsonl").read_text().splitlines()]
    result["final_step_accuracy"] = log[-1]["step_accuracy"]
    result["tokens_per_s"] = log[-1]["tokens_per_s"]
    table[name] = result
out.write_text(json.dumps(table, indent=2) + "\n")
print(f"{'run':24} {'held-out tau':>12} {'acceptance by depth':>28} {'train tok/s':>12}")
for name, r in table.items():
    depth = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"][:4])
    print(f"{name:24} {r['tau']:12.2f} {depth:>28} {r['tokens_per_s']:12.0f}")
print(f"wrote {out}")
