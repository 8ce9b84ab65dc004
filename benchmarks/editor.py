"""Fill-in-the-middle completion as an editor sends it (llama.cpp's ``/infill``, as llama.vim
and llama.vscode do), to our server with default settings and with ``--draft none`` (plain
decoding through the same loop; mlx-lm's server has no fill-in-the-middle), side by side.

    python benchmarks/editor.py [--model GGUF_OR_DIR] [--sites 4] [--steps 4] [--max-tokens 128]
        [--servers ours,ours-none] [--out benchmarks/results/editor.json]

The file is real code: Python's own ``textwrap.py``. At each site, a function whose body is
being written: the editor holds the signature and the body's last line, and the user types
the body's first lines a few characters at a time; after each keystroke burst (``--steps``,
8 characters apart) the editor asks for the middle (``n_predict`` 128, llama.vim's default),
sending the 40 lines before the cursor and the 20 after it (llama.vim sends a window around
the cursor, 256 and 64 lines by default: smaller here, for this CPU's prompt reading). Sites follow one
another in the same file, as a session does. Greedy. Reported: whether every middle is the
same text from both servers, the whole session's time on each and the speedup, and the
decoding alone (tokens after the first, per second), with each request's figures.
"""

import argparse
import ast
import json
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import add_model_argument, servers  # noqa: E402

from mlx_eagle.models import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEFORE, AFTER = 40, 20  # lines sent before and after the cursor


def sites(source: str, count: int) -> List[Tuple[int, int, int]]:
    """(first body line, last body line, the body's indentation) of functions whose bodies run
    3 to 12 lines, in file order, ``count`` of them spread over the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.body:
            body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
            if body and 3 <= node.end_lineno - body[0].lineno + 1 <= 12:
                found.append((body[0].lineno - 1, node.end_lineno - 1, body[0].col_offset))
    found.sort()
    step = max(1, len(found) // count)
    return found[::step][:count]


def requests_of(source: str, count: int, steps: int) -> List[dict]:
    """The /infill bodies an editor sends while the sites' bodies are typed."""
    lines = source.splitlines(keepends=True)
    bodies = []
    for first, last, _ in sites(source, count):
        typed = "".join(lines[first:last])  # the body but its last line, typed from its start
        before = "".join(lines[max(0, first - BEFORE):first])
        after = "".join(lines[last:last + AFTER])
        for step in range(steps):
            bodies.append({"input_prefix": before + typed[:8 * step], "input_suffix": after})
    return bodies


def infill(base: str, body: dict, max_tokens: int) -> Tuple[dict, float]:
    data = json.dumps({**body, "n_predict": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(base + "/infill", data=data, headers={"Content-Type": "application/json"})
    tic = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as response:
        reply = json.loads(response.read())
    return reply, time.perf_counter() - tic


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="requests per site, 8 typed characters apart")
    parser.add_argument("--max-tokens", type=int, default=128, help="n_predict: 128 as llama.vim's default")
    parser.add_argument("--servers", default="ours,ours-none")
    parser.add_argument("--port", type=int, default=8591)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "editor.json")
    args = parser.parse_args(argv)
    bodies = requests_of(Path(textwrap.__file__).read_text(), args.sites, args.steps)
    model_dir = resolve_model(args.model)
    kinds = args.servers.split(",")
    results = {kind: [] for kind in kinds}
    with servers(kinds, model_dir, args.port) as clients:
        bases = {kind: str(client.base_url).rstrip("/").removesuffix("/v1") for kind, client in clients.items()}
        for index, body in enumerate(bodies):
            for kind in kinds[index % len(kinds):] + kinds[:index % len(kinds)]:
                reply, seconds = infill(bases[kind], body, args.max_tokens)
                usage = reply["usage"]
                results[kind].append({
                    "seconds": seconds, "tokens": reply["tokens_predicted"], "content": reply["content"],
                    "time_to_first_token": usage["time_to_first_token"], "cached_tokens": usage[
                        "prompt_tokens_details"]["cached_tokens"], "prompt_tokens": usage["prompt_tokens"],
                    "drafters": usage["speculation"]["drafters"]})
            print(f"request {index + 1}/{len(bodies)}: " + ", ".join(
                f"{k} {results[k][-1]['seconds']:.2f} s" for k in kinds), file=sys.stderr)
    totals = {kind: sum(r["seconds"] for r in results[kind]) for kind in kinds}
    decoding = {kind: sum(r["tokens"] - 1 for r in results[kind]) /
                sum(r["seconds"] - r["time_to_first_token"] for r in results[kind]) for kind in kinds}
    both = {"ours", "ours-none"} <= set(kinds)
    result = {
        "model": str(model_dir), "file": "textwrap.py", "requests": len(bodies), "max_tokens": args.max_tokens,
        "identical": all([r["content"] for r in results[k]] == [r["content"] for r in results[kinds[0]]]
                         for k in kinds),
        "seconds": totals, "speedup": totals["ours-none"] / totals["ours"] if both else None,
        "decoding_tokens_per_second": decoding,
        "decoding_speedup": decoding["ours"] / decoding["ours-none"] if both else None, "by_request": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"identical middles: {result['identical']}")
    print("session: " + ", ".join(f"{k} {totals[k]:.1f} s ({decoding[k]:.1f} tokens/s decoding)" for k in kinds))
    if both:
        print(f"speedup over plain decoding (--draft none): {result['speedup']:.2f}x the session, "
              f"{result['decoding_speedup']:.2f}x decoding alone")
    drafted = {}
    for r in results[kinds[0]]:
        for name, stats in r["drafters"].items():
            d = drafted.setdefault(name, [0, 0])
            d[0], d[1] = d[0] + stats["accepted"], d[1] + stats["proposed"]
    print("drafted (accepted/proposed): " + ", ".join(f"{n}: {a}/{p}" for n, (a, p) in drafted.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
