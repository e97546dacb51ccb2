"""pytest-benchmark twin of ``bench_ttft.py`` at small sizes (4 chunks x 128 tokens, S=32, Q=16).

    pytest perf/ --benchmark-enable

Not collected by the default ``pytest`` run (its testpaths is tests/). Same workload, engine
configuration and cache checks as the script; one engine alive at a time (class-scoped fixtures:
vanilla's engine is shut down when its class is done, before graphchunk's starts). The
timed call is ``generate`` of one request with ``max_tokens=1``; each round gets the next prompt of
its phase from ``setup`` (uncounted), and graphchunk's counters are checked for every request.
Timings are reported, not asserted: at these sizes the question dominates and no target applies.
"""
from __future__ import annotations

import argparse

import pytest

from perf.serving import bench_ttft as B
from perf.common import harness as H
from perf.serving import ttft_workload as W

CHUNKS, CHUNK_TOKENS, SYS_TOKENS, QUESTION_TOKENS = 4, 128, 32, 16
ROUNDS, WARMUP = 5, 1
RESULTS: dict[str, list[float]] = {}


@pytest.fixture(scope="module")
def model_path():
    H.script_env()  # as the script's main: offline, vLLM's step timeout, perf/ importable by the engine core
    return str(H.resolve_model(None))


@pytest.fixture(scope="module")
def workload(model_path):
    return W.build_workload(H.load_tokenizer(model_path), sweep=[CHUNKS], chunk_tokens=CHUNK_TOKENS,
                            sys_tokens=SYS_TOKENS, question_tokens=QUESTION_TOKENS, repeats=ROUNDS, warmup=WARMUP,
                            seed=0)


@pytest.fixture(scope="module")
def setup(model_path, workload):
    args = argparse.Namespace(dtype="bfloat16", block_size=128, sweep=[CHUNKS], chunk_tokens=CHUNK_TOKENS,
                              sys_tokens=SYS_TOKENS, question_tokens=QUESTION_TOKENS, kv_cache_bytes=0,
                              max_num_seqs=8, seed=0, enforce_eager=False)
    return B.engine_setup(args, model_path, workload)


class Phase:
    """Feeds one phase's requests to ``benchmark.pedantic`` and checks each one afterwards."""

    def __init__(self, kind: str, engine, workload: W.Workload, setup: B.EngineSetup, requests: list[W.Request]):
        self.kind, self.engine, self.workload, self.setup = kind, engine, workload, setup
        self.pending = list(requests)
        self.current: W.Request | None = None
        self.before: dict = {}
        self.output = None
        self.times: list[tuple[W.Request, float]] = []
        self.failures: list[str] = []
        self.done: set[tuple[str, int, int]] = getattr(engine, "_bench_done", set())
        engine._bench_done = self.done

    def run_untimed(self, req: W.Request) -> None:
        ids, bounds = self.workload.prompt(req)
        H.timed_generate(self.engine, {"prompt_token_ids": ids}, self._params(bounds))
        self.done.add((req.phase, req.k, req.index))

    def _params(self, bounds):
        return B.sampling_params(bounds if self.kind == "graphchunk" else None)

    def next_round(self):
        self._close()
        req = self.pending.pop(0)
        if req.phase == "hit" and req.source is not None and ("miss", req.k, req.source) not in self.done:
            # Run on its own (e.g. with -k): cache the documents first, untimed.
            self.run_untimed(next(r for r in self.workload.requests
                                  if r.phase == "miss" and r.k == req.k and r.index == req.source))
        self.current, self.before = req, H.engine_stats(self.engine)
        ids, bounds = self.workload.prompt(req)
        return ({"prompt_token_ids": ids}, self._params(bounds)), {}

    def target(self, prompt, params):
        self.output, seconds = H.timed_generate(self.engine, prompt, params)
        self.times.append((self.current, seconds))

    def _close(self) -> None:
        req, self.current = self.current, None
        if req is None:
            return
        self.done.add((req.phase, req.k, req.index))
        delta = H.counter_delta(self.before, H.engine_stats(self.engine), B.STAT_KEYS)
        self.failures += B.check_request(self.kind, req, self.output, delta, self.workload, sys_tokens=SYS_TOKENS,
                                         question_tokens=QUESTION_TOKENS,
                                         block_size=self.setup.llm_kwargs["block_size"])[2]

    def finish(self, benchmark, name: str) -> None:
        self._close()
        counted = [t for r, t in self.times if r.counted]
        RESULTS[name] = counted
        benchmark.extra_info.update(chunks=CHUNKS, chunk_tokens=CHUNK_TOKENS, sys_tokens=SYS_TOKENS,
                                    question_tokens=QUESTION_TOKENS, own_ttft_s=counted)
        assert not self.failures, self.failures


def run_phase(benchmark, kind, engine, workload, setup, phase: str, name: str) -> None:
    requests = [r for r in workload.requests if r.k == CHUNKS and r.phase == phase]
    runner = Phase(kind, engine, workload, setup, requests)
    if kind == "graphchunk":  # the global warm-up computes the sys entry; a miss must then be k misses
        if ("global_warmup", 1, 0) not in runner.done:
            runner.run_untimed(workload.requests[0])
    benchmark.group = f"ttft {CHUNKS}x{CHUNK_TOKENS}"
    benchmark.pedantic(runner.target, setup=runner.next_round, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    runner.finish(benchmark, name)


@pytest.fixture(scope="class")
def vanilla_engine(setup):
    engine = H.make_engine("vanilla", setup.llm_kwargs)
    yield engine
    H.shutdown(engine)


@pytest.fixture(scope="class")
def graphchunk_engine(setup):
    engine = H.make_engine("graphchunk", setup.llm_kwargs, {**setup.graphchunk, "mode": "isolated"})
    yield engine
    H.shutdown(engine)


class TestVanilla:
    def test_vanilla(self, benchmark, vanilla_engine, workload, setup):
        """Full prefill: the all-hit prompts (documents reordered, a first one never first)."""
        run_phase(benchmark, "vanilla", vanilla_engine, workload, setup, "hit", "vanilla")


class TestGraphChunk:
    def test_graphchunk_all_miss(self, benchmark, graphchunk_engine, workload, setup):
        run_phase(benchmark, "graphchunk", graphchunk_engine, workload, setup, "miss", "all_miss")

    def test_graphchunk_all_hit(self, benchmark, graphchunk_engine, workload, setup):
        run_phase(benchmark, "graphchunk", graphchunk_engine, workload, setup, "hit", "all_hit")


def test_ratios(record_property):
    """Reports speedup_all_hit and ratio_all_miss from the three measurements above (no target)."""
    if not all(name in RESULTS for name in ("vanilla", "all_miss", "all_hit")):
        pytest.skip("needs test_vanilla, test_graphchunk_all_miss and test_graphchunk_all_hit in this session")
    p50 = {name: H.percentile(times, 50) for name, times in RESULTS.items()}
    if None in p50.values():  # pytest-benchmark timed nothing: the project's addopts disable it
        pytest.skip("benchmarks are disabled (addopts: --benchmark-disable); run with --benchmark-enable")
    ratios = dict(speedup_all_hit=p50["vanilla"] / p50["all_hit"], ratio_all_miss=p50["all_miss"] / p50["vanilla"])
    for name, value in ratios.items():
        record_property(name, value)
    print(f"\n{CHUNKS}x{CHUNK_TOKENS} p50 ms: " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in p50.items())
          + f"; speedup_all_hit {ratios['speedup_all_hit']:.2f}, ratio_all_miss {ratios['ratio_all_miss']:.3f}")
