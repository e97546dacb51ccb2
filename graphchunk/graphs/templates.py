"""Graph templates of the cached-chunk prefill: one per bucket, captured ahead of traffic, replayed per step.

Host side (``choose``): a step whose requests all compute only their question over cached context
maps to the smallest bucket of the grid that holds it; any other step with a cached-chunk prefill
in it counts as a fallback and runs eager. Device side (``replay``): the runner pads the step to
the bucket's token count in vLLM's persistent input buffers and replays the bucket's template;
a template that cannot run the inputs as captured (``ReplayMiss``, nothing computed) falls back
to eager, which is exact, and is counted.
"""
from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from graphchunk.graphs.buckets import Bucket, BucketGrid, RequestShape
from graphchunk.graphs.graph_backends import Forward, ReplayMiss, make_backend
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


class GraphTemplates:
    def __init__(self, grid: BucketGrid, metrics: CacheMetrics):
        self.grid = grid
        self.metrics = metrics
        self.backend = make_backend(grid.backend, len(grid.buckets))
        self.templates: dict[Bucket, Any] = {}
        self.reports: list[CaptureReport] = []
        self.replays: dict[str, int] = {}
        self.enabled = True
        """Off: every step runs eager, uncounted (the side-by-side eager baseline of tests and perf/)."""

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
        """The bucket a step with a cached-chunk prefill replays on; None (counted) runs eager.
        ``requests`` is None when the step also computes other work (context tokens, other requests)."""
        if not self.enabled:
            return None
        bucket = self.grid.bucket_for(requests) if requests else None
        if bucket is None:
            self.metrics.graph_fallbacks += 1
        return bucket

    def replay(self, bucket: Bucket, eager: Forward, **inputs):
        try:
            output = self.templates[bucket].replay(**inputs)
        except ReplayMiss as exc:
            self.metrics.graph_fallbacks += 1
            logger.warning("graphchunk: template %s could not replay this step, ran eager: %s", bucket.name, exc)
            return eager(**inputs)
        self.metrics.graph_replays += 1
        self.replays[bucket.name] = self.replays.get(bucket.name, 0) + 1
        return output

    def manifest(self) -> dict:
        return {"grid": self.grid.source, "backend": self.grid.backend,
                "buckets": [{**asdict(report), "replays": self.replays.get(report.bucket, 0)}
                            for report in self.reports]}


def _memory_in_use(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    if device.type == "npu":
        return torch.npu.memory_reserved(device)
    import psutil

    return psutil.Process().memory_info().rss
