"""What graphchunk costs per step at a GPU server's scale, on the host: vLLM's own scheduler with and
without graphchunk's connector, and graphchunk's worker host path over a null KV device.

    .venv/bin/python -m perf.host.bench_host_scale                  # the whole grid: run it alone
    .venv/bin/python -m perf.host.bench_host_scale --quick          # smoke run, ~20 s
    .venv/bin/python -m perf.host.bench_host_scale --running 256 --entries 1000 100000 --modes isolated
    .venv/bin/python -m perf.host.bench_host_scale --label before --graphchunk-tree /path/to/older/worktree
    .venv/bin/python -m perf.host.bench_host_scale --modes blend --setting recompute_block=16 --label blocks \
        --out perf/results/host_scale_blocks.json   # a graphchunk setting for every run (repeatable)
    .venv/bin/python -m perf.host.bench_host_scale --replot         # the plot again from the result file

No model runs and no KV moves: the question is what the host adds to a step that a GPU runs in 10-30
ms (DESIGN.md §10). vLLM 0.32's own synchronous ``Scheduler`` (a real ``VllmConfig`` of the model,
blocks of 16, ``max_num_batched_tokens`` 8192 as on an H200 server, ``max_num_seqs`` the running
count, KV blocks enough that nothing is preempted) schedules every step, with graphchunk's
connector (``kv_transfer_config`` = ``connector_config(None)``) or without (vanilla, plain prompts of
the same tokens). Its one worker rank is graphchunk's own ``ChunkEngine`` over ``NullDevice`` (a
``KVDevice`` whose forwards and copies do nothing; its question-aware scores are pseudo-random, so
blend's selection is as scattered as a model's). The metrics file is on, as under ``vllm serve``,
so both sides publish.

Workload. A pool pre-populated (untimed) with ``--entries`` ready entries (documents of about
``--doc-tokens`` tokens behind one ``--sys-tokens`` system prompt: isolated entries keyed by
(sys, chunk), blend's by the chunk alone); requests of the system prompt, ``--docs`` documents drawn
Zipf-like (exponent ``--zipf``) from the pool's and a ``--question-tokens`` question, ``--out-tokens``
tokens out; every lookup a hit. Per configuration (mode x running x entries), three phases:

* admission: ``--running`` requests arrive at once; every step until all run (blend admits as many
  as its ``recompute_budget`` allows a step: one, with the default policy);
* decode: all run, none finishes: ``--decode-steps`` steps;
* steady: each finished request replaced at once by a new one (finishes staggered over
  ``--out-tokens`` steps, so finishes and admissions come every step): ``--steady-steps`` steps.

Per step: vLLM's scheduler time (``schedule()`` + ``update_from_output()`` + ``has_requests()``, the
engine core's loop), the connector's share of it (every scheduler-side connector method, timed on
the instance), vLLM's own (the difference), and the worker's host time (``ChunkEngine.step``'s entry
and exit, ``fill_context``, ``rewrite_positions`` on a batch laid out as vLLM's ``InputBatch``,
``count_step``, and what the worker's connector reports). Written per phase: median and p99 of each,
the connector's ratio to vLLM's own (medians, same run), vanilla vLLM's median in the same run, the
acceptance of issue 62 (``acceptance``). Results merge by ``--label`` into ``runs[LABEL]`` of the
result file (other labels kept); the plot draws every label.

Only graphchunk's entry points that older trees have too are used (``ContextScheduler`` through the
connector, its planner's ``plan``/``release`` and ``reported`` to pre-populate, ``ChunkEngine``'s
hooks), so ``--graphchunk-tree`` (or a ``PYTHONPATH`` naming a tree with a ``graphchunk/`` package)
measures another worktree's graphchunk with this script.
"""
from __future__ import annotations

import argparse
import gc
import json
import operator
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from perf.common import harness as H
from perf.common.vllm_scheduler import vllm_scheduler
from perf.host.report import PHASES, acceptance, fit_slopes, phase_line, plot, summarize

BLOCK = 16
VOCAB = 49152
"""SmolLM2's vocabulary: token ids are drawn below it (no tokenizer runs)."""
SAMPLED = 1000
"""The token every request samples (an ordinary word, no stop token)."""
CONNECTOR_METHODS = (
    "get_num_new_matched_tokens", "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids",
    "update_state_after_alloc", "build_connector_meta", "update_connector_output", "request_finished",
    "request_finished_all_groups", "register_finished_partial_tail", "take_events", "has_pending_block_frees",
    "has_pending_push_work", "get_kv_connector_stats", "on_new_request")
"""The connector's scheduler-side methods vLLM's ``Scheduler`` calls (those the instance has are timed)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m perf.host.bench_host_scale", description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=["isolated", "blend"], choices=["isolated", "blend"])
    p.add_argument("--running", nargs="+", type=int, default=[64, 256, 1024], help="running requests")
    p.add_argument("--entries", nargs="+", type=int, default=[1000, 10000, 100000], help="pool entries")
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--steady-steps", type=int, default=20)
    p.add_argument("--sys-tokens", type=int, default=100)
    p.add_argument("--docs", type=int, default=5, help="documents per request")
    p.add_argument("--doc-tokens", type=int, default=200, help="a document's mean length (+-10 %%)")
    p.add_argument("--question-tokens", type=int, default=30)
    p.add_argument("--out-tokens", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.0, help="exponent of the documents' popularity")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--scores", choices=["random", "zeros"], default="random",
                   help="the null device's question-aware scores: pseudo-random (scattered picks, as a "
                        "model's) or zeros (contiguous picks)")
    p.add_argument("--no-vanilla", action="store_true", help="skip vLLM without graphchunk")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the set-up's objects (the pool's entries) to Python's collector during the steps")
    p.add_argument("--model", default="smollm2", help="the model whose ModelConfig vLLM builds (no weights load)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--setting", action="append", type=graphchunk_setting, metavar="KEY=JSON",
                   help="a graphchunk setting of the run (repeatable), e.g. recompute_block=16")
    p.add_argument("--label", default="after", help="the run's name in the result file (runs[LABEL])")
    p.add_argument("--graphchunk-tree", type=Path,
                   help="a worktree whose graphchunk/ package to measure (default: a PYTHONPATH entry holding "
                        "one, else this checkout's)")
    p.add_argument("--replot", action="store_true", help="only draw --plot from --out")
    p.add_argument("--out", type=Path, default=H.REPO / "perf/results/host_scale.json")
    p.add_argument("--plot", type=Path, default=H.REPO / "perf/results/host_scale.png")
    quick_dir = Path(tempfile.gettempdir())
    return H.parse_with_quick(p, argv, dict(running=[16, 64], entries=[100, 1000], decode_steps=4, steady_steps=4,
                                            out=quick_dir / "host_scale_quick.json",
                                            plot=quick_dir / "host_scale_quick.png"))


# --- which graphchunk -----------------------------------------------------------------------------

def use_graphchunk_tree(explicit: Path | None) -> Path | None:
    """Puts the tree whose graphchunk is measured first on ``sys.path`` (``python -m`` puts the
    current directory before ``PYTHONPATH``): ``explicit``, else the first ``PYTHONPATH`` entry holding
    a ``graphchunk/`` package other than this checkout. Returns it (None: this checkout's)."""
    tree = explicit
    if tree is None:
        for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if (Path(entry) / "graphchunk" / "__init__.py").exists() and Path(entry).resolve() != H.REPO:
                tree = Path(entry)
                break
    if tree is None:
        return None
    tree = tree.resolve()
    if not (tree / "graphchunk" / "__init__.py").exists():
        raise SystemExit(f"--graphchunk-tree {tree}: no graphchunk/ package there")
    loaded = sys.modules.get("graphchunk")
    if loaded is not None and not Path(loaded.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"graphchunk is already imported from {loaded.__file__}, not from {tree}")
    sys.path.insert(0, str(tree))
    return tree


def graphchunk_source() -> dict:
    import graphchunk

    path = Path(graphchunk.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(path), "status", "--porcelain", "."], capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return dict(path=str(path), commit=commit, dirty=dirty)


# --- workload -------------------------------------------------------------------------------------

class Corpus:
    """The system prompt and ``entries`` documents (token tuples over shared int objects, so that
    100k documents and the pool's copies of them stay small), their Zipf popularity, and the
    requests made of them."""

    def __init__(self, entries: int, args, seed: int):
        self.args, self.rng = args, np.random.default_rng(seed)
        vocab = tuple(range(VOCAB))
        self._tokens = lambda ids: operator.itemgetter(*ids)(vocab) if len(ids) > 1 else (vocab[ids[0]],)
        rng = self.rng
        spread = max(1, args.doc_tokens // 10)
        lengths = rng.integers(args.doc_tokens - spread, args.doc_tokens + spread + 1, entries)
        ids = rng.integers(256, VOCAB, int(lengths.sum()))
        ends = np.cumsum(lengths)
        # The first two tokens name the document: no two documents are alike.
        ids[ends - lengths] = 256 + np.arange(entries) % (VOCAB - 256)
        ids[ends - lengths + 1] = 256 + np.arange(entries) // (VOCAB - 256)
        self.docs = [self._tokens(part.tolist()) for part in np.split(ids, ends[:-1])]
        self.sys = self._tokens(rng.integers(256, VOCAB, args.sys_tokens).tolist())
        weights = np.arange(1, entries + 1, dtype=float) ** -args.zipf
        cdf = np.cumsum(weights[rng.permutation(entries)])
        self.cdf = cdf / cdf[-1]

    def pick(self) -> list[int]:
        """``--docs`` distinct documents, Zipf-like."""
        count = min(self.args.docs, len(self.docs))
        chosen: list[int] = []
        while len(chosen) < count:
            doc = int(np.searchsorted(self.cdf, self.rng.random(), side="right"))
            if doc < len(self.docs) and doc not in chosen:
                chosen.append(doc)
        return chosen

    def prompt(self) -> tuple[list[int], list[int]]:
        """(token ids, boundaries: each chunk's start and the question's)."""
        tokens, boundaries = list(self.sys), []
        for doc in self.pick():
            boundaries.append(len(tokens))
            tokens += self.docs[doc]
        boundaries.append(len(tokens))
        tokens += self._tokens(self.rng.integers(256, VOCAB, self.args.question_tokens).tolist())
        return tokens, boundaries

    @property
    def longest_prompt(self) -> int:
        longest = sorted(map(len, self.docs))[-self.args.docs:]
        return len(self.sys) + sum(longest) + self.args.question_tokens


class NullDevice:
    """A ``KVDevice`` (``graphchunk/device.py``) that moves nothing: forwards and copies return at
    once, reads return zeros of their shape; the question-aware scoring pass returns fixed
    pseudo-random scores. Counts the pseudo-sequences it is handed."""

    def __init__(self, max_tokens: int, scores: str, seed: int):
        import torch

        generator = torch.Generator().manual_seed(seed)
        self.scores = torch.rand(max_tokens, generator=generator) if scores == "random" else torch.zeros(max_tokens)
        self.prefilled = self.scored = 0

    def prefill(self, seqs, num_layers=None) -> None:
        self.prefilled += len(seqs)

    def context_attention(self, seqs, num_layers=None):
        self.scored += len(seqs)
        return [self.scores[: seq.num_cached] for seq in seqs]

    def copy_blocks(self, src_blocks, dst_blocks) -> None:
        pass

    def copy_slots(self, src_slots, dst_slots, key_temperature: float = 1.0) -> None:
        pass

    def copy_slots_rotated(self, src_slots, dst_slots, deltas) -> None:
        pass

    def read_keys(self, layer, slots):
        import torch

        return torch.zeros(len(slots), 1, 1)

    def sum_over_ranks(self, values):
        return values

    def read_blocks(self, block_ids):
        import torch

        return torch.zeros(len(block_ids))

    def write_blocks(self, block_ids, data) -> None:
        pass

    def request_blocks(self, req_id: str) -> list[int]:
        return []


class Timed:
    """perf_counter accumulators around a connector's scheduler-side methods (on the instance: vLLM
    calls them through ``scheduler.connector``); a call inside another counts once."""

    def __init__(self, connector):
        self.total, self.by, self._depth = 0, {}, 0
        for name in CONNECTOR_METHODS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._wrap(name, method))

    def _wrap(self, name, method):
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            self._depth += 1
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    spent = clock() - start
                    self.total += spent
                    self.by[name] = self.by.get(name, 0) + spent
        return timed

    def reset(self) -> None:
        self.total, self.by = 0, {}


# --- one configuration ------------------------------------------------------------------------------

class Setting:
    """vLLM's scheduler (with graphchunk's connector when ``mode`` is given) and, with it, graphchunk's
    worker engine over a null device, its pool pre-populated with every document of ``corpus``."""

    def __init__(self, args, model_path, corpus: Corpus, mode: str | None, running: int, max_model_len: int):
        self.args, self.corpus, self.mode, self.running = args, corpus, mode, running
        self.count = 0
        self.setup_s = {}
        started = time.perf_counter()
        self.scheduler, self.hasher = self._scheduler(model_path, running, max_model_len)
        self.setup_s["scheduler"] = time.perf_counter() - started
        self.engine = self.timed = self.annotator = None
        if mode is not None:
            self._graphchunk(max_model_len)

    @property
    def kv_blocks(self) -> int:
        return self.running * -(-self.max_model_len // BLOCK) + self.running

    def _scheduler(self, model_path, running: int, max_model_len: int):
        from graphchunk.engine.connector import connector_config

        self.max_model_len = max_model_len
        self.gc_settings = {"mode": self.mode, **dict(self.args.setting or [])} if self.mode else None
        scheduler, config, hasher = vllm_scheduler(
            model_path, num_blocks=self.kv_blocks, block_size=BLOCK,
            max_num_batched_tokens=self.args.max_num_batched_tokens, max_num_seqs=running,
            max_model_len=max_model_len, kv_transfer_config=connector_config(None) if self.mode else None,
            additional_config={"graphchunk": self.gc_settings} if self.mode else {}, log_stats=False)
        self.model = config.model_config
        return scheduler, hasher

    def _graphchunk(self, max_model_len: int) -> None:
        """The worker's engine and its handshake, as ``kv_binding.bind_engine`` builds them (pool
        blocks past vLLM's), the metrics file on, and the pool pre-populated."""
        import dataclasses

        from graphchunk.cache.context_run import ContextRunner
        from graphchunk.cache.keys import KeySpace
        from graphchunk.config import GraphChunkConfig
        from graphchunk.engine.chunk_engine import ChunkEngine
        from graphchunk.engine.connector import GraphChunkHandshake
        from graphchunk.engine.context_scheduler import PoolHandshake
        from graphchunk.engine.frontend import RequestAnnotator
        from graphchunk.metrics import METRICS_FILE_ENV, WORKER_FIELDS, CacheMetrics, MetricsPublisher, new_metrics_file

        args = self.args
        config = GraphChunkConfig.from_dict(self.gc_settings)
        self.config = config
        self.annotator = RequestAnnotator(dataclasses.replace(config, separator=""), tokenizer=None)
        offset = args.sys_tokens % BLOCK if self.mode == "isolated" else 0
        pool_blocks = -(-args.sys_tokens // BLOCK) + sum(-(-(offset + len(doc)) // BLOCK) for doc in self.corpus.docs)
        pool_blocks += pool_blocks // 20 + 64  # no eviction
        space = KeySpace(f"{self.model.model}@", "torch.float32", "tp1-pp1")
        handshake = PoolHandshake(self.kv_blocks, pool_blocks, BLOCK, space, None, None)
        saved = os.environ.get(METRICS_FILE_ENV)
        self.metrics_file = new_metrics_file()  # as under vllm serve: both sides publish
        try:
            self.scheduler.connector.set_xfer_handshake_metadata({0: GraphChunkHandshake(handshake)})
            runner = ContextRunner(BLOCK, args.max_num_batched_tokens, CacheMetrics())
            self.device = NullDevice(max_model_len, args.scores, args.seed)
            self.engine = ChunkEngine(config, runner.metrics, runner, self.device, handshake,
                                      args.max_num_batched_tokens)
            self.engine.publisher = MetricsPublisher(self.metrics_file, WORKER_FIELDS)
        finally:
            if saved is None:
                os.environ.pop(METRICS_FILE_ENV, None)
            else:
                os.environ[METRICS_FILE_ENV] = saved
        self.pool_blocks = pool_blocks
        started = time.perf_counter()
        self._populate()
        self.setup_s["populate"] = time.perf_counter() - started
        self.timed = Timed(self.scheduler.connector)

    def _populate(self) -> None:
        """Every document of the corpus a ready pool entry (behind the system prompt's), planned by
        the scheduler's planner, its jobs run by the worker (stamping the entries' blocks) and
        reported run: what a warm server holds. Checked: the planner finds nothing missing."""
        context = self.scheduler.connector._context()
        runner = self.engine.runner
        for seg in self._segments():
            plan = context.planner.plan(seg, None, self.mode, 0, seg.layout.context_len)
            runner.add_jobs(plan.jobs)
            runner.run_jobs(self.device, None)
            context.planner.release(plan)
        context.reported(runner.done_before)
        missing = sum(context.planner.missing_tokens(seg, None, self.mode, 0, seg.layout.context_len)
                      for seg in self._segments())
        if missing:
            raise RuntimeError(f"the pre-populated pool misses {missing} tokens of the corpus")
        self.entries = len(self.corpus.docs) + 1  # every document and the system prompt
        self.pool_blocks_used = int(context.metrics.pool_blocks_used)

    def _segments(self):
        """The corpus's documents behind its system prompt, 32 to a segmented prompt."""
        from graphchunk.segments import split_at

        docs = self.corpus.docs
        per = max(1, min(self.config.max_chunks, 32))
        for first in range(0, len(docs), per):
            tokens, boundaries = list(self.corpus.sys), []
            for doc in docs[first: first + per]:
                boundaries.append(len(tokens))
                tokens += doc
            boundaries.append(len(tokens))
            tokens.append(SAMPLED)
            yield split_at(tokens, boundaries, max_chunks=self.config.max_chunks,
                           max_chunk_len=self.config.max_chunk_len)

    def close(self) -> None:
        path = getattr(self, "metrics_file", None)
        if path and os.path.exists(path):
            os.remove(path)

    # --- requests and steps -----------------------------------------------------------------------

    def request(self, max_tokens: int):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        tokens, boundaries = self.corpus.prompt()
        self.count += 1
        if self.mode is None:
            return Request(f"r{self.count}", tokens, SamplingParams(max_tokens=max_tokens), None,
                           block_hasher=self.hasher)
        params = SamplingParams(max_tokens=max_tokens, extra_args={"graphchunk_boundaries": boundaries})
        shell = SimpleNamespace(prompt_token_ids=tokens, sampling_params=params, lora_request=None, mm_features=None,
                                cache_salt=None)
        self.annotator.annotate(shell)
        return Request(f"r{self.count}", tokens, params, None, cache_salt=shell.cache_salt, block_hasher=self.hasher)

    def step(self) -> tuple[dict, list[str]]:
        """One engine step: (its record, the requests that finished in it)."""
        scheduler, clock = self.scheduler, time.perf_counter_ns
        if self.timed is not None:
            self.timed.reset()
        start = clock()
        so = scheduler.schedule()
        scheduled = clock() - start
        output, worker_ns, counts = self.work(so)
        start = clock()
        outputs = scheduler.update_from_output(so, output)
        scheduler.has_requests()
        updated = clock() - start
        finished = [out.request_id for outs in outputs.values() for out in outs.outputs
                    if out.finish_reason is not None]
        total = scheduled + updated
        connector = self.timed.total if self.timed is not None else 0
        running, waiting = scheduler.get_request_counts()
        record = dict(total_ms=total / 1e6, connector_ms=connector / 1e6, vllm_own_ms=(total - connector) / 1e6,
                      worker_host_ms=worker_ns / 1e6, running=running, waiting=waiting,
                      admitted=len(so.scheduled_new_reqs), finished=len(finished),
                      tokens=so.total_num_scheduled_tokens, **counts)
        if self.timed is not None:
            record["connector_by_method_ms"] = {name: ns / 1e6 for name, ns in self.timed.by.items()}
        return record, finished

    def work(self, so):
        """The worker's part of step ``so``: (vLLM's ``ModelRunnerOutput``, graphchunk's host ns, counts)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from graphchunk.engine.connector import GraphChunkWorkerMeta, work_of
        from graphchunk.engine.context_scheduler import computed_before

        import torch

        requests = self.scheduler.requests
        req_ids = list(so.num_scheduled_tokens)
        computed = computed_before(so)
        num = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int64, len(req_ids))
        before = np.fromiter((computed[r] for r in req_ids), np.int64, len(req_ids))
        sampled = [[SAMPLED] if b + n >= requests[r].num_prompt_tokens else []
                   for r, b, n in zip(req_ids, before.tolist(), num.tolist())]
        counts: dict = {}
        connector_output, worker_ns = None, 0
        if self.engine is not None:
            engine, device = self.engine, self.device
            # vLLM's InputBatch as rewrite_positions reads it: rows, computed tokens before the step,
            # the query offsets in row order and the step's positions.
            query_start = np.zeros(len(req_ids) + 1, np.int32)
            np.cumsum(num, out=query_start[1:])
            batch = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                    num_computed_tokens_cpu=before.astype(np.int32))
            total = int(query_start[-1])
            positions = torch.from_numpy(np.repeat(before - query_start[:-1], num) + np.arange(total))
            fills = len(work_of(so.kv_connector_metadata).fills)
            device.prefilled = device.scored = 0
            clock = time.perf_counter_ns
            start = clock()
            with engine.step(so):
                engine.fill_context()
                engine.rewrite_positions(batch, query_start, positions)
                engine.count_step(total, total, False)
            loaded, invalid, failed = engine.take_loaded(), engine.take_invalid(), engine.take_failed()
            meta = GraphChunkWorkerMeta(engine.done_before, frozenset(failed))
            worker_ns = clock() - start
            if invalid or failed:
                raise RuntimeError(f"fills failed their check: blocks {sorted(invalid)[:8]}, "
                                   f"entries {sorted(failed)[:8]}")
            connector_output = KVConnectorOutput(finished_recving=loaded or None, invalid_block_ids=invalid,
                                                 kv_connector_worker_meta=meta)
            counts = dict(fills=fills, pseudo_seqs=device.prefilled, scored_seqs=device.scored)
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled, kv_connector_output=connector_output)
        return output, worker_ns, counts


def run_setting(setting: Setting, args) -> dict[str, list[dict]]:
    """The three phases' step records, the set-up's objects frozen out of Python's collector."""
    scheduler, running = setting.scheduler, setting.running
    requests = [setting.request(setting.max_model_len) for _ in range(running)]
    for request in requests:
        scheduler.add_request(request)
    if not args.no_gc_freeze:
        gc.collect()
        gc.freeze()
    try:
        return run_phases(setting, args, requests)
    finally:
        if not args.no_gc_freeze:
            gc.unfreeze()


def run_phases(setting: Setting, args, requests) -> dict[str, list[dict]]:
    """Admission (``requests`` waiting), decode, steady."""
    scheduler, running = setting.scheduler, setting.running
    steps = {phase: [] for phase in PHASES}
    limit = 2 * running + 64
    while scheduler.get_request_counts() != (running, 0):
        record, finished = setting.step()
        steps["admission"].append(record)
        if finished or len(steps["admission"]) > limit:
            raise RuntimeError(f"admission of {running} requests: {len(steps['admission'])} steps, "
                               f"{len(finished)} finished, counts {scheduler.get_request_counts()}")
    # From here on no request finishes for --decode-steps steps; then they finish staggered over
    # --out-tokens steps, each replaced at once (the steady state).
    for i, request in enumerate(requests):
        request.max_tokens = request.num_output_tokens + args.decode_steps + 1 + i % args.out_tokens
        if request.num_tokens + request.max_tokens - request.num_output_tokens >= setting.max_model_len:
            raise RuntimeError("max_model_len too small for the phases")
    for _ in range(args.decode_steps):
        record, finished = setting.step()
        if finished:
            raise RuntimeError(f"{len(finished)} requests finished in a decode step")
        steps["decode"].append(record)
    for _ in range(args.steady_steps):
        record, finished = setting.step()
        steps["steady"].append(record)
        for _ in finished:
            scheduler.add_request(setting.request(args.out_tokens))
    return steps


# --- the run -----------------------------------------------------------------------------------------

def max_model_len(corpus: Corpus, args, running: int) -> int:
    """Room for the longest prompt, one token per admission step (blend admits one request a step),
    the decode phase and the staggered finishes."""
    need = corpus.longest_prompt + running + args.decode_steps + args.out_tokens + 64
    return -(-need // 256) * 256


def measure(args) -> dict:
    model_path = H.resolve_model(args.model)
    configs, vanilla = [], {}
    corpora = {}

    def corpus_of(entries: int) -> Corpus:
        if entries not in corpora:
            corpora.clear()  # one at a time: 100k documents are ~0.3 GB
            corpora[entries] = Corpus(entries, args, args.seed)
        return corpora[entries]

    for running in args.running:
        if not args.no_vanilla:
            corpus = corpus_of(min(args.entries))
            setting = Setting(args, model_path, corpus, None, running, max_model_len(corpus, args, running))
            started = time.perf_counter()
            steps = run_setting(setting, args)
            vanilla[str(running)] = dict(running=running, entries=min(args.entries),
                                         wall_s=round(time.perf_counter() - started, 2),
                                         phases={p: summarize(steps[p], p, False) for p in PHASES})
            print(f"vanilla   R={running:5d}: " + phase_line(vanilla[str(running)]["phases"]), flush=True)
            del setting
            gc.collect()
        for entries in args.entries:
            corpus = corpus_of(entries)
            for mode in args.modes:
                setting = Setting(args, model_path, corpus, mode, running, max_model_len(corpus, args, running))
                started = time.perf_counter()
                try:
                    steps = run_setting(setting, args)
                finally:
                    setting.close()
                phases = {p: summarize(steps[p], p, True) for p in PHASES}
                alone = vanilla.get(str(running), {}).get("phases", {})
                config = dict(mode=mode, running=running, entries=entries,
                              pool=dict(entries=setting.entries, blocks=setting.pool_blocks,
                                        blocks_used=setting.pool_blocks_used),
                              setup_s={k: round(v, 2) for k, v in setting.setup_s.items()},
                              wall_s=round(time.perf_counter() - started, 2), phases=phases,
                              connector_ratio_admission=phases["admission"].get("connector_ratio"),
                              connector_ratio_decode=phases["decode"].get("connector_ratio"),
                              connector_ratio_steady=phases["steady"].get("connector_ratio"),
                              vanilla_ms_p50={p: (alone[p]["total_ms"] or {}).get("p50") if p in alone else None
                                              for p in PHASES})
                configs.append(config)
                print(f"{mode:9s} R={running:5d} E={entries:6d}: " + phase_line(phases), flush=True)
                del setting, steps
                gc.collect()
    fits = fit_slopes(configs)
    return dict(configs=configs, vanilla=vanilla, fits=fits, acceptance=acceptance(configs, fits))


def workload(args) -> dict:
    return dict(sys_tokens=args.sys_tokens, docs_per_request=args.docs, doc_tokens=f"{args.doc_tokens} +-10%",
                question_tokens=args.question_tokens, out_tokens=args.out_tokens, zipf=args.zipf, block_size=BLOCK,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs="the running count",
                scores=args.scores, gc_freeze=not args.no_gc_freeze,
                timed=dict(vllm="schedule() + update_from_output() + has_requests() per step",
                           connector="the connector's scheduler-side methods inside it (" +
                                     ", ".join(CONNECTOR_METHODS) + ")",
                           vllm_own="vllm - connector",
                           worker="ChunkEngine.step entry and exit + fill_context + rewrite_positions + count_step "
                                  "+ take_loaded/take_invalid/take_failed/done_before, over a null device"))


def graphchunk_setting(item: str) -> tuple[str, object]:
    """``KEY=JSON`` as (key, value): a ``GraphChunkConfig`` setting for every run's engine."""
    key, eq, value = item.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"--setting {item!r}: expected KEY=JSON, e.g. recompute_block=16")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string


def merge(path: Path, label: str, run: dict) -> dict:
    """The result file with ``run`` under ``runs[label]`` (other labels kept); its command the
    'after' run's when there is one, else this one's."""
    result = json.loads(path.read_text()) if path.exists() else {}
    runs = dict(result.get("runs", {}))
    runs[label] = run
    command = (runs.get("after") or run)["command"]
    return dict(benchmark="host_scale", question="What does graphchunk cost per step at my scale?",
                command=command, labels=sorted(runs), runs=runs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        plot(json.loads(args.out.read_text()), args.plot)
        print(f"wrote {args.plot}")
        return 0
    tree = use_graphchunk_tree(args.graphchunk_tree)
    H.script_env()
    if tree is not None and sys.path[0] != str(tree):  # script_env put this checkout first
        sys.path.insert(0, str(tree))
    clock = H.RunClock()
    source = graphchunk_source()
    print(f"graphchunk from {source['path']} ({source['commit']}{', dirty' if source['dirty'] else ''})", flush=True)
    found = measure(args)
    clock.mark("end")
    run = dict(command=H.command_line(__file__, argv), device=H.device_name(), environment=clock.environment(),
               graphchunk=source, config=H.config_dict(args, skip=("out", "plot", "replot", "label")),
               workload=workload(args), **found)
    result = merge(args.out, args.label, run)
    H.write_json(args.out, result)
    plot(result, args.plot)
    print(json.dumps({k: v for k, v in found["acceptance"].items() if k.endswith("ok") or k == "passed"}))
    print(f"wrote {args.out} and {args.plot} in {run['environment']['wall_s']:.0f} s")
    return 0



if __name__ == "__main__":
    sys.exit(main())
