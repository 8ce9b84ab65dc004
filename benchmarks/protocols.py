"""benchmarks/agent.py's tool loop through each protocol the server speaks, side by side:
OpenAI's chat completions (the ``openai`` SDK), Anthropic's Messages (the ``anthropic`` SDK)
and OpenAI's Responses (the ``openai`` SDK, each turn continuing the last by
``previous_response_id``); and what ``/metrics`` costs.

    python benchmarks/protocols.py [--model GGUF_OR_DIR] [--tasks 4] [--max-tokens 160]
        [--protocols chat,messages,responses] [--out benchmarks/results/protocols.json]

Each protocol gets a server of its own (ours, default settings), started together and fresh,
so that none reads another's earlier replies or cached prompts; tasks rotate which goes
first. Greedy. Reported: whether the transcripts are identical across protocols (the same
conversation is the same prompt through each), each protocol's tool-loop time and its ratio
to chat completions'.

Then the metrics' cost, measured where it is spent: the server's per-request bookkeeping
(``Metrics.observe`` over a reply of this run's mean length, each token's gap included) and a
scrape (``GET /metrics``, rendering every family), timed over many calls, against the tool
loop's mean request time, with a scrape every 15 s (Prometheus' common interval).
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import anthropic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import SYSTEM, TASKS, TOOLS, add_model_argument, run_task, run_tool, servers  # noqa: E402

from mlx_eagle.drafters.composite import SourceStats  # noqa: E402
from mlx_eagle.generation import GenerationResponse  # noqa: E402
from mlx_eagle.metrics import Metrics, Telemetry  # noqa: E402
from mlx_eagle.models import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def figures(seconds: float, tokens: int, calls: List, first: bool) -> dict:
    return {"kind": "tool call" if calls else ("answer" if first else "answer after tool results"),
            "seconds": seconds, "tokens": tokens}


def run_messages(client: anthropic.Anthropic, task: str, max_tokens: int) -> Tuple[List[dict], List[dict]]:
    """agent.run_task's loop through the Messages API."""
    messages = [{"role": "user", "content": task}]
    transcript, requests = [], []
    for turn in range(4):
        tic = time.perf_counter()
        reply = client.messages.create(model="default_model", system=SYSTEM, messages=messages,
                                       tools=ANTHROPIC_TOOLS, max_tokens=max_tokens)
        seconds = time.perf_counter() - tic
        uses = [b for b in reply.content if b.type == "tool_use"]
        calls = [(b.name, b.input) for b in uses]
        requests.append(figures(seconds, reply.usage.output_tokens, calls, turn == 0))
        transcript.append({"content": "" if calls else "".join(b.text for b in reply.content if b.type == "text"),
                           "calls": calls})
        if not calls:
            break
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in uses]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                   "content": run_tool(b.name, b.input)} for b in uses]}]
    return transcript, requests


def run_responses(client, task: str, max_tokens: int) -> Tuple[List[dict], List[dict]]:
    """agent.run_task's loop through the Responses API, each turn continuing the stored last."""
    items: List[dict] = [{"role": "user", "content": task}]
    previous: Optional[str] = None
    transcript, requests = [], []
    for turn in range(4):
        tic = time.perf_counter()
        reply = client.responses.create(model="default_model", instructions=SYSTEM, input=items,
                                        previous_response_id=previous, tools=RESPONSES_TOOLS,
                                        max_output_tokens=max_tokens)
        seconds = time.perf_counter() - tic
        made = [i for i in reply.output if i.type == "function_call"]
        calls = [(i.name, json.loads(i.arguments)) for i in made]
        requests.append(figures(seconds, reply.usage.output_tokens, calls, turn == 0))
        transcript.append({"content": "" if calls else reply.output_text, "calls": calls})
        if not calls:
            break
        previous = reply.id
        items = [{"type": "function_call_output", "call_id": i.call_id, "output": run_tool(n, a)}
                 for i, (n, a) in zip(made, calls)]
    return transcript, requests


def metrics_cost(mean_tokens: float, samples: int = 2000) -> Dict[str, float]:
    """Seconds per request of the metrics' bookkeeping, and per scrape of /metrics."""
    metrics = Metrics({"requests_waiting": ("waiting", lambda: 0.0)})
    tokens = max(1, round(mean_tokens))
    last = GenerationResponse(text="", token=0, from_draft=False, prompt_tokens=500, prompt_tps=0.0,
                              generation_tokens=tokens, generation_tps=0.0, peak_memory=0.0, finish_reason="stop",
                              sources={"context lookup": SourceStats(40, 20), "eagle": SourceStats(80, 50)},
                              target_forwards=tokens // 2, prompt_reused=400)
    seen = Telemetry(first_token_seconds=0.1, last=last, gaps=[0.02] * (tokens - 1))
    tic = time.perf_counter()
    for _ in range(samples):
        metrics.observe("/v1/chat/completions", 200, 1.0, seen)
    observe = (time.perf_counter() - tic) / samples
    tic = time.perf_counter()
    for _ in range(samples // 10):
        metrics.text()
    return {"observe_seconds": observe, "scrape_seconds": (time.perf_counter() - tic) / (samples // 10)}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--tasks", type=int, default=len(TASKS))
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--protocols", default="chat,messages,responses")
    parser.add_argument("--port", type=int, default=8491, help="the first of three consecutive ports")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "protocols.json")
    args = parser.parse_args(argv)
    kinds = args.protocols.split(",")
    model_dir = resolve_model(args.model)
    with servers(kinds, model_dir, args.port) as clients:  # one fresh server of ours per protocol
        runners = {
            "chat": lambda task: run_task(clients["chat"], task, args.max_tokens),
            "messages": lambda task: run_messages(anthropic.Anthropic(
                base_url=str(clients["messages"].base_url).rstrip("/").removesuffix("/v1"), api_key="local",
                max_retries=0, timeout=1800), task, args.max_tokens),
            "responses": lambda task: run_responses(clients["responses"], task, args.max_tokens),
        }
        transcripts = {kind: [] for kind in kinds}
        requests = {kind: [] for kind in kinds}
        for index, task in enumerate(TASKS[:args.tasks]):
            for kind in kinds[index % len(kinds):] + kinds[:index % len(kinds)]:
                transcript, made = runners[kind](task)
                transcripts[kind].append(transcript)
                requests[kind] += made
            print(f"task {index + 1}/{args.tasks}: " + ", ".join(
                f"{k} {sum(r['seconds'] for r in requests[k][-len(transcripts[k][-1]):]):.1f} s" for k in kinds),
                file=sys.stderr)
    totals = {kind: sum(r["seconds"] for r in requests[kind]) for kind in kinds}
    reference = kinds[0]
    all_requests = [r for kind in kinds for r in requests[kind]]
    mean_seconds = sum(r["seconds"] for r in all_requests) / len(all_requests)
    cost = metrics_cost(sum(r["tokens"] for r in all_requests) / len(all_requests))
    share = (cost["observe_seconds"] + cost["scrape_seconds"] * mean_seconds / 15.0) / mean_seconds
    result = {
        "model": str(model_dir), "tasks": args.tasks, "max_tokens": args.max_tokens,
        "identical": all(transcripts[k] == transcripts[reference] for k in kinds),
        "seconds": totals, "vs_" + reference: {k: totals[reference] / totals[k] for k in kinds},
        "metrics": {**cost, "mean_request_seconds": mean_seconds, "share_of_request_time": share},
        "requests": requests, "transcripts": transcripts[reference],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"identical transcripts across protocols: {result['identical']}")
    print(f"{'protocol':10} {'tool loop s':>11} {'speed vs ' + reference:>14}")
    for kind in kinds:
        print(f"{kind:10} {totals[kind]:11.1f} {totals[reference] / totals[kind]:13.3f}x")
    print(f"metrics: {cost['observe_seconds'] * 1e6:.0f} us per request, {cost['scrape_seconds'] * 1e3:.2f} ms per "
          f"scrape; {share:.4%} of a mean {mean_seconds:.2f} s request (a scrape every 15 s)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
