"""What the server shows an operator at ``GET /metrics``, in Prometheus' text format
(through prometheus_client), and the JSON line per request that ``--log-requests`` writes.

Counted per request when it ends: requests by route and status; prompt, cached and
completion tokens; time to first token, time between tokens and whole-request time
(histograms); per drafter, the draft tokens proposed and accepted; target forward passes and
rechecks; the conversations its verify passes held on average (the batch). Read when
scraped: the prompt caches' bytes, stored responses' bytes, requests waiting for a seat and
replies in progress. ``Telemetry``: one request's times, as its reply comes.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, TextIO

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from .generation import GenerationResponse

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


@dataclass
class Telemetry:
    """One request's times, kept as its reply's pieces come (``see``): from its arrival to
    its first token, between tokens, and its last piece; ``text``: the reply's text so far,
    where it is kept (None: not kept)."""

    arrived: float = field(default_factory=time.monotonic)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    first_token_seconds: Optional[float] = None
    last: Optional["GenerationResponse"] = None
    token_at: float = 0.0
    gaps: List[float] = field(default_factory=list)
    text: Optional[str] = None

    def see(self, response: "GenerationResponse") -> None:
        now = time.monotonic()
        if self.first_token_seconds is None:
            self.first_token_seconds = now - self.arrived
        else:
            self.gaps.append(now - self.token_at)
        self.last, self.token_at = response, now
        if self.text is not None:
            self.text += getattr(response, "reasoning", "") + response.text


class Metrics:
    """One server's metrics, in a registry of its own. ``gauges``: name -> (help, reading)
    for the values read when scraped."""

    def __init__(self, gauges: Dict[str, "tuple[str, Callable[[], float]]"]):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("mlx_eagle_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("mlx_eagle_prompt_tokens", "Prompt tokens of the requests served",
                                     registry=registry)
        self.cached_tokens = Counter("mlx_eagle_prompt_cache_hit_tokens",
                                     "Prompt tokens found in the prompt cache (not read again)", registry=registry)
        self.cache_hits = Counter("mlx_eagle_prompt_cache_hits", "Requests that found part of their prompt cached",
                                  registry=registry)
        self.completion_tokens = Counter("mlx_eagle_completion_tokens", "Tokens generated", registry=registry)
        self.first_token = Histogram("mlx_eagle_time_to_first_token_seconds",
                                     "From a request's arrival to its first token (queue and prompt included)",
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.between_tokens = Histogram("mlx_eagle_time_between_tokens_seconds",
                                        "Between a reply's successive tokens as handed out (a round's come together)",
                                        buckets=GAP_BUCKETS, registry=registry)
        self.duration = Histogram("mlx_eagle_request_duration_seconds", "Whole requests, arrival to last byte",
                                  buckets=LATENCY_BUCKETS, registry=registry)
        self.proposed = Counter("mlx_eagle_draft_tokens_proposed", "Draft tokens verified, per drafter", ["drafter"],
                                registry=registry)
        self.accepted = Counter("mlx_eagle_draft_tokens_accepted", "Draft tokens the target accepted, per drafter",
                                ["drafter"], registry=registry)
        self.forwards = Counter("mlx_eagle_target_forwards", "Target forward passes (rounds and rechecks)",
                                registry=registry)
        self.rechecks = Counter("mlx_eagle_rechecks", "Greedy positions too close to call in a block, read alone",
                                registry=registry)
        self.batch_rows = Histogram("mlx_eagle_batch_rows", "Conversations per verify pass, averaged per reply",
                                    buckets=(1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32), registry=registry)
        for name, (help_, reading) in gauges.items():
            Gauge(f"mlx_eagle_{name}", help_, registry=registry).set_function(reading)

    def observe(self, route: str, status: int, seconds: float, telemetry: Telemetry) -> None:
        """One request, ended: its route and status, and what its reply did."""
        self.requests.labels(route, str(status)).inc()
        self.duration.observe(seconds)
        last, first_token, gaps = telemetry.last, telemetry.first_token_seconds, telemetry.gaps
        if last is None:
            return
        self.prompt_tokens.inc(last.prompt_tokens)
        self.cached_tokens.inc(last.prompt_reused)
        if last.prompt_reused:
            self.cache_hits.inc()
        self.completion_tokens.inc(last.generation_tokens)
        if first_token is not None:
            self.first_token.observe(first_token)
        for gap in gaps:
            self.between_tokens.observe(gap)
        for name, stats in last.sources.items():
            self.proposed.labels(name).inc(stats.proposed)
            self.accepted.labels(name).inc(stats.accepted)
        self.forwards.inc(last.target_forwards)
        self.rechecks.inc(last.rechecked)
        self.batch_rows.observe(last.batch_rows)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def log_line(out: TextIO, route: str, status: int, seconds: float, telemetry: Telemetry,
             usage: Optional[Dict[str, Any]], prompt: Optional[str] = None) -> None:
    """``--log-requests``: one JSON line for a request that ended (the prompt's and reply's
    text only when given and kept: ``--log-text``)."""
    last, first_token, text = telemetry.last, telemetry.first_token_seconds, telemetry.text
    line: Dict[str, Any] = {"id": telemetry.request_id, "route": route, "status": status, "seconds": round(seconds, 4),
                            "time_to_first_token": round(first_token, 4) if first_token is not None else None}
    if last is not None and usage is not None:
        line.update(prompt_tokens=usage["prompt_tokens"], cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
                    completion_tokens=usage["completion_tokens"], finish_reason=last.finish_reason,
                    speculation=usage["speculation"])
    if prompt is not None:
        line["prompt"] = prompt
    if text is not None:
        line["text"] = text
    out.write(json.dumps(line, ensure_ascii=False) + "\n")
    out.flush()

