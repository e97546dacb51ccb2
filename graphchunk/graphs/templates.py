"""Graph templates of the cached-chunk prefill: one per bucket, captured ahead of traffic, replayed per step.

Host side (``choose``): a step whose requests all compute only their question over cached context
maps to the smallest bucket of the grid that holds it. Device side: with graphchunk's own
templates (backends ``compile``, ``eager``) the runner pads the step to the bucket's token count in
vLLM's persistent input buffers and ``replay`` runs the bucket's template; a template that cannot
run the inputs as captured (``ReplayMiss``, nothing computed) falls back to eager, which is exact.
With backend ``vllm`` graphchunk captures nothing: vLLM's own graphs (CUDA graphs at the grid's
token counts, ``engine/graph_config.py``; on CPU its one compiled dynamic-shape graph) run the step.

Every step with a cached-chunk prefill in it is counted once (``count``): ``graph_replays`` when
it ran a captured graph at exactly its token count, ``graph_padded`` when it ran one padded to
more tokens, ``graph_eager`` otherwise: with graphchunk's templates, no bucket holds it, it mixes
in other work, or a replay miss; with ``vllm``, vLLM dispatched it to no graph (a step no bucket
holds counts by what vLLM ran, under ``outside_buckets`` in the manifest).
"""
from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from graphchunk.graphs.buckets import Bucket, BucketGrid, RequestShape
from graphchunk.graphs.graph_backends import Forward, ReplayMiss, make_backend
from graphchunk.graphs.graph_safety import CheckedBackend, ContextReads
from graphchunk.metrics import CacheMetrics

logger = logging.getLogger("graphchunk")


class TemplateCaptureError(RuntimeError):
    """Capturing one bucket's template failed; the message names the bucket."""


@dataclass(frozen=True)
class CaptureReport:
    bucket: str
    num_tokens: int
    seconds: float
    memory_bytes: int


COUNTERS = {"replayed": "graph_replays", "padded": "graph_padded", "eager": "graph_eager"}
"""Each outcome of a step with a cached-chunk prefill, and the metric counting it."""
OUTCOMES = tuple(COUNTERS)


class GraphTemplates:
    def __init__(self, grid: BucketGrid, metrics: CacheMetrics, context_reads: ContextReads | None = None,
                 uncompiled: Callable[[], AbstractContextManager] = nullcontext):
        self.grid = grid
        self.metrics = metrics
        self.captures = grid.backend != "vllm"
        """False: vLLM's own graphs replay the buckets; graphchunk captures and pads nothing."""
        self.backend = make_backend(grid.backend, len(grid.buckets)) if self.captures else None
        if grid.checked:
            self.backend = CheckedBackend(self.backend, context_reads, uncompiled)
        self.templates: dict[Bucket, Any] = {}
        self.reports: list[CaptureReport] = []
        self.outcomes: dict[str, dict[str, int]] = {}
        """Per bucket name ('' for steps no bucket holds): counts of each outcome."""
        self.enabled = True
        """Off: graphchunk's templates are neither chosen nor counted (the side-by-side baseline of
        tests and perf/: vLLM's own forward, compiled or eager as the engine was started)."""

    def capture_all(self, fn: Forward, inputs_for: Callable[[Bucket], dict[str, Any]],
                    context_for: Callable[[Bucket], AbstractContextManager], device: torch.device,
                    progress: bool = True) -> list[CaptureReport]:
        """Captures every bucket (smallest first) with a progress bar; raises TemplateCaptureError."""
        from tqdm import tqdm

        bar = tqdm(self.grid.buckets, desc=f"graphchunk: capturing {self.grid.backend} templates", unit="bucket",
                   disable=not progress)
        for bucket in bar:
            bar.set_postfix_str(bucket.name)
            before, start = _memory_in_use(device), time.perf_counter()
            try:
                with context_for(bucket):
                    self.templates[bucket] = self.backend.capture(fn, inputs_for(bucket))
            except Exception as exc:
                raise TemplateCaptureError(f"capturing graph template {bucket.name} ({self.grid.backend}, "
                                           f"{bucket.num_tokens} tokens) failed: {exc}") from exc
            report = CaptureReport(bucket.name, bucket.num_tokens, time.perf_counter() - start,
                                   _memory_in_use(device) - before)
            self.reports.append(report)
            self.metrics.graph_captures += 1
            logger.info("graphchunk: captured %s in %.2f s (%+.1f MiB)", bucket.name, report.seconds,
                        report.memory_bytes / 2**20)
        return self.reports

    def choose(self, requests: list[RequestShape] | None) -> Bucket | None:
        """The bucket holding a step with a cached-chunk prefill, or None. ``requests`` is None when
        the step also computes other work (context tokens, other requests)."""
        return self.grid.bucket_for(requests) if requests else None

    def count(self, outcome: str, bucket: Bucket | None) -> None:
        """Counts one step with a cached-chunk prefill (``OUTCOMES``)."""
        counter = COUNTERS[outcome]
        setattr(self.metrics, counter, getattr(self.metrics, counter) + 1)
        row = self.outcomes.setdefault(bucket.name if bucket else "", dict.fromkeys(OUTCOMES, 0))
        row[outcome] += 1

    def replay(self, bucket: Bucket, eager: Forward, **inputs):
        """Runs graphchunk's template of ``bucket``; False second: it ran eager (a replay miss)."""
        try:
            return self.templates[bucket].replay(**inputs), True
        except ReplayMiss as exc:
            logger.warning("graphchunk: template %s could not replay this step, ran eager: %s", bucket.name, exc)
            return eager(**inputs), False

    def manifest(self, vllm_graphs: dict | None = None) -> dict:
        """What was captured (by graphchunk, per bucket; by vLLM, ``vllm_graphs``) and how steps ran."""
        reports = {report.bucket: asdict(report) for report in self.reports}  # none when vLLM captures
        zero = dict.fromkeys(OUTCOMES, 0)
        return {"grid": self.grid.source, "backend": self.grid.backend, "checked": self.grid.checked,
                "captured_by": "graphchunk" if self.captures else "vllm", "vllm_graphs": vllm_graphs,
                "buckets": [{"bucket": b.name, **reports.get(b.name, {}), **self.outcomes.get(b.name, zero)}
                            for b in self.grid.buckets],
                "outside_buckets": self.outcomes.get("", zero)}


def _memory_in_use(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    if device.type == "npu":
        return torch.npu.memory_reserved(device)
    import psutil

    return psutil.Process().memory_info().rss
