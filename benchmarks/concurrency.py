"""Concurrent clients against three OpenAI-compatible servers on this machine, side by side:
mlx-lm's own (``python -m mlx_lm.server``, batching by default), ours with default settings
and ours with ``--draft none``; also, by ``--servers``, ``ours-rows``, ``ours-no-ride`` and
``ours-own-odds``: ours with one of the batch's levers off (benchmarks/levers.py: the
drafters drafting one conversation after another; new prompts read between the rounds, not
inside their pass; a new conversation's odds for the batch's nodes not its plan's).

    python benchmarks/concurrency.py [--model GGUF_OR_DIR] [--clients 1,2,4,8,16]
        [--workloads chat,agent] [--requests 2] [--max-tokens 64]
        [--servers mlx-lm,ours,ours-none] [--repeat-prompts] [--out benchmarks/results/concurrency.json]
        [--plot PNG]

Workloads:
- ``chat``: each of C clients sends ``--requests`` chat prompts one after another (MT-bench
  questions and edit-style rewrites, alternating; a client's prompts are its own, and each
  level's are new to every server unless ``--repeat-prompts``), streamed, greedy,
  ``--max-tokens`` each, all clients starting together;
- ``agent``: C agents run benchmarks/agent.py's tool loop at once (task i % 4 each), greedy.
One server is measured at a time (the others idle), the order rotating per level.

Reported per server, workload and level: aggregate completion tokens/s (all clients' tokens
over the level's wall time), p50 and p95 request latency, p50 time to first token and p99 time
between a reply's deliveries (chat; streamed: a round's tokens may arrive together), and
whether every reply was the same text on every server and at every level (each request's
reply alone: the level-1 replies are the reference where they overlap).
A table on standard output, the JSON in ``--out``, and a plot of tokens/s and p50 latency
against clients (``--plot``).
"""

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import TASKS, add_model_argument, run_task, servers  # noqa: E402 (the sibling script's workload and servers)

from mlx_eagle.bench import mtbench_suite, read_prompts  # noqa: E402
from mlx_eagle.models import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def chat_prompts(count: int, skip: int = 0) -> List[str]:
    """MT-bench first turns and edit-style rewrites, alternating while both last (100 in
    all, then again from the first), from the ``skip``-th on."""
    questions = [p.turns[0] for p in mtbench_suite()]
    edits = [p.turns[0] for p in read_prompts(ROOT / "benchmarks" / "prompts" / "edit.jsonl")]
    mixed = [prompt for pair in zip(questions, edits) for prompt in pair] + questions[len(edits):]
    return [mixed[(skip + i) % len(mixed)] for i in range(count)]


def chat_request(client: openai.OpenAI, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request: its text, tokens, latency, time to first token and the gaps
    between its deliveries after the first (a round's tokens may arrive together)."""
    tic = time.perf_counter()
    first, text, tokens, gaps, last = None, "", None, [], None
    stream = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            if last is None:
                first = now - tic
            else:
                gaps.append(now - last)
            last = now
            text += chunk.choices[0].delta.content
            chunks += 1
    return {"prompt": prompt, "text": text, "tokens": tokens if tokens is not None else chunks,
            "seconds": time.perf_counter() - tic, "first_token": first, "gaps": gaps}


def agent_request(client: openai.OpenAI, task: str, max_tokens: int) -> dict:
    """One agent's whole tool loop (several requests): its transcript, tokens and time."""
    tic = time.perf_counter()
    transcript, requests = run_task(client, task, max_tokens)
    return {"prompt": task, "text": json.dumps(transcript), "tokens": sum(r["tokens"] for r in requests),
            "seconds": time.perf_counter() - tic, "first_token": None, "gaps": []}


def run_level(client: openai.OpenAI, workload: str, clients: int, requests: int, max_tokens: int,
              skip: int = 0) -> dict:
    """``clients`` clients at once; each one's requests one after another (chat prompts from
    the ``skip``-th on)."""
    prompts = chat_prompts(clients * requests, skip) if workload == "chat" else [TASKS[i % len(TASKS)]
                                                                                 for i in range(clients)]
    per_client = requests if workload == "chat" else 1
    done: List[List[dict]] = [[] for _ in range(clients)]
    errors: List[BaseException] = []
    gate = threading.Barrier(clients)

    def one(index: int) -> None:
        gate.wait()
        try:
            for j in range(per_client):
                prompt = prompts[index * per_client + j]
                done[index].append(chat_request(client, prompt, max_tokens) if workload == "chat"
                                   else agent_request(client, prompt, max_tokens))
        except BaseException as error:  # reported after the level
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    tic = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - tic
    if errors:
        raise SystemExit(f"error: a client failed: {errors[0]!r}")
    replies = [reply for client_replies in done for reply in client_replies]
    latencies = sorted(r["seconds"] for r in replies)
    firsts = sorted(r["first_token"] for r in replies if r["first_token"] is not None)
    gaps = sorted(gap for r in replies for gap in r["gaps"])
    return {"clients": clients, "wall_seconds": wall, "tokens": sum(r["tokens"] for r in replies),
            "tokens_per_s": sum(r["tokens"] for r in replies) / wall,
            "p50_latency": statistics.median(latencies), "p95_latency": percentile(latencies, 0.95),
            "p50_first_token": statistics.median(firsts) if firsts else None,
            "p99_between_tokens": percentile(gaps, 0.99) if gaps else None,
            "replies": {r["prompt"]: r["text"] for r in replies}}


def percentile(values: List[float], q: float) -> float:
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(result["runs"])
    figure, axes = plt.subplots(len(workloads), 2, figsize=(10, 3.6 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        for kind, levels in result["runs"][workload].items():
            clients = [level["clients"] for level in levels]
            axes[row][0].plot(clients, [level["tokens_per_s"] for level in levels], marker="o", label=kind)
            axes[row][1].plot(clients, [level["p50_latency"] for level in levels], marker="o", label=kind)
        for column, label in enumerate(["aggregate tokens/s", "p50 request latency (s)"]):
            axes[row][column].set_xscale("log", base=2)
            axes[row][column].set_xlabel("concurrent clients")
            axes[row][column].set_ylabel(label)
            axes[row][column].set_title(f"{workload}: {label}")
            axes[row][column].legend()
    figure.suptitle(f"{Path(result['model']).name}: {result['max_tokens']} tokens a reply, greedy")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--clients", default="1,2,4,8,16", help="concurrency levels, comma-separated")
    parser.add_argument("--workloads", default="chat,agent", help="chat, agent, or both")
    parser.add_argument("--requests", type=int, default=2, help="chat prompts each client sends, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--servers", default="mlx-lm,ours,ours-none")
    parser.add_argument("--port", type=int, default=8491, help="the first of three consecutive ports")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "concurrency.json")
    parser.add_argument("--repeat-prompts", action="store_true",
                        help="every level sends the same first prompts (a server that drafts from earlier "
                        "replies has seen them); by default each level's chat prompts are new to every server")
    parser.add_argument("--plot", type=Path, help="write the plot here (a .png)")
    args = parser.parse_args(argv)
    kinds, levels = args.servers.split(","), [int(c) for c in args.clients.split(",")]
    workloads = args.workloads.split(",")
    if not set(workloads) <= {"chat", "agent"}:
        raise SystemExit(f"error: --workloads takes chat and agent, not {args.workloads}")
    model_dir = resolve_model(args.model)  # a GGUF is converted once, as --model converts it
    runs: Dict[str, Dict[str, List[dict]]] = {w: {k: [] for k in kinds} for w in workloads}
    with servers(kinds, model_dir, args.port, timeout=3600) as clients:
        for workload in workloads:
            for index, level in enumerate(levels):
                skip = 0 if args.repeat_prompts else sum(levels[:index]) * args.requests
                for kind in kinds[index % len(kinds):] + kinds[:index % len(kinds)]:
                    run = run_level(clients[kind], workload, level, args.requests, args.max_tokens, skip)
                    runs[workload][kind].append(run)
                    print(f"{workload} {level:2} clients {kind:9}: {run['tokens_per_s']:6.1f} tokens/s, "
                          f"p50 {run['p50_latency']:6.1f} s", file=sys.stderr, flush=True)
    reference: Dict[str, str] = {}
    identical = True
    for workload in workloads:
        for kind in kinds:
            for run in runs[workload][kind]:
                for prompt, text in run["replies"].items():
                    identical &= reference.setdefault(f"{workload}:{prompt}", text) == text
    result = {"model": str(model_dir), "max_tokens": args.max_tokens, "requests_per_client": args.requests,
              "repeat_prompts": args.repeat_prompts, "identical": identical, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    base = "mlx-lm" if "mlx-lm" in kinds else kinds[0]
    print(f"identical replies on every server and at every level: {identical}")
    print(f"{'workload':8} {'clients':>7} {'server':10} {'tokens/s':>9} {'vs ' + base:>10} {'p50 s':>7} {'p95 s':>7} "
          f"{'p50 TTFT':>9} {'p99 gap':>8}")
    for workload in workloads:
        for index, level in enumerate(levels):
            for kind in kinds:
                run = runs[workload][kind][index]
                ratio = run["tokens_per_s"] / runs[workload][base][index]["tokens_per_s"]
                first = f"{run['p50_first_token']:9.2f}" if run["p50_first_token"] is not None else f"{'':9}"
                gap = run["p99_between_tokens"]
                gap = f"{gap:8.2f}" if gap is not None else f"{'':8}"
                print(f"{workload:8} {level:7} {kind:10} {run['tokens_per_s']:9.1f} {ratio:9.2f}x "
                      f"{run['p50_latency']:7.1f} {run['p95_latency']:7.1f} {first} {gap}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
