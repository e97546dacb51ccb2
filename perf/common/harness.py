"""What the perf scripts share: the process's settings, models and engines, timing statistics,
the result file's common parts, and plots.

* process: ``script_env()`` (called by each script's ``main``; the library never touches the
  environment), ``resolve_model``, ``load_tokenizer``;
* engines: ``kv_bytes_per_token``, ``llm_kwargs`` (the vLLM flags every in-process bench builds:
  prefix caching on, one-step prefills, a fixed KV budget), ``make_engine`` (vanilla ``vllm.LLM``
  or ``GraphChunkLLM``), ``shutdown``, ``engine_stats`` / ``counter_delta`` (graphchunk's
  counters around a request), ``ttft_params`` / ``timed_generate`` (one request, its wall time);
* statistics: ``percentile``, ``percentiles`` (p50/p90/mean/min/max/n), ``ratio``;
* results: ``device_name``, ``git_state``, ``versions``, ``RunClock`` (load averages, start and
  wall time), ``parse_with_quick`` (a script's ``--quick`` sizes), ``config_dict``, ``command_line``,
  ``write_json``;
* plots: ``pyplot`` (matplotlib, headless), ``save_figure``.

Workload text comes from ``graphchunk.reference.text`` (CPython's help topics), as in the tests.
"""
from __future__ import annotations

import gc
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


# --- process ------------------------------------------------------------------------------------

def script_env() -> None:
    """A perf script's process settings, set by its ``main`` before any engine exists (engine
    cores and servers it spawns inherit them):

    * ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``: every model here is a local checkpoint
      (``graphchunk.reference.models``) and the hub is unreachable from these machines, so a
      model given by hub name fails at once instead of retrying;
    * ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``: vLLM kills the engine when one step takes over 300 s;
      a 4k-token bf16 prefill on a CPU without native bf16 under load comes close, and that step
      is what the benches measure;
    * the repository on ``PYTHONPATH`` and ``sys.path``: a spawned engine core or server must
      import ``perf`` modules too (``perf.answers.force_tokens.ForceTokens``, a logits processor;
      ``perf.soak.fill_faults.FaultyRunner``, a worker)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def resolve_model(name: str | None) -> Path:
    """None or ``smollm2``: the bundled SmolLM2-135M-Instruct; ``tiny-ARCH``: a tiny test
    checkpoint; anything else: a path."""
    from graphchunk.reference import models

    if name is None or name == "smollm2":
        return models.smollm2_path()
    if name.startswith("tiny-"):
        return models.tiny_checkpoint(name.removeprefix("tiny-"))
    return Path(name)


def load_tokenizer(model_path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_path)


# --- engines ------------------------------------------------------------------------------------

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_token(model_path, dtype: str) -> int:
    """KV-cache bytes one token takes over all layers (keys and values) in ``dtype``."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * DTYPE_BYTES[dtype]


def llm_kwargs(model: str, *, dtype: str, block_size: int, max_model_len: int, max_num_seqs: int,
               kv_cache_bytes: int, seed: int, enforce_eager: bool, **extra) -> dict:
    """``vllm.LLM`` keyword arguments of a bench engine: vLLM's prefix caching on, a fixed KV
    budget (``kv_cache_memory_bytes``, of which graphchunk carves its pool), and
    ``max_num_batched_tokens = max_model_len`` so no prefill is chunked; ``extra`` is added."""
    return dict(model=model, dtype=dtype, enable_prefix_caching=True, block_size=block_size,
                max_model_len=max_model_len, max_num_batched_tokens=max_model_len, max_num_seqs=max_num_seqs,
                kv_cache_memory_bytes=int(kv_cache_bytes), seed=seed, enforce_eager=enforce_eager, **extra)


def make_engine(kind: str, kwargs: dict, graphchunk: dict | None = None):
    """``vanilla``: ``vllm.LLM(**kwargs)``; otherwise ``GraphChunkLLM`` with the ``graphchunk`` settings."""
    if kind == "vanilla":
        from vllm import LLM

        return LLM(**kwargs)
    from graphchunk.llm import GraphChunkLLM

    kwargs = dict(kwargs)
    return GraphChunkLLM(kwargs.pop("model"), graphchunk=graphchunk, **kwargs)


def shutdown(engine) -> None:
    if hasattr(engine, "shutdown") and hasattr(engine, "llm"):  # GraphChunkLLM
        engine.shutdown()
    else:
        core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
    gc.collect()


def engine_stats(engine) -> dict[str, float]:
    """graphchunk's counters (``GraphChunkLLM.stats``); {} for a vanilla engine."""
    return engine.stats() if hasattr(engine, "stats") else {}


def counter_delta(before: dict, after: dict, keys) -> dict:
    """``after - before`` for each of ``keys`` both hold: whole numbers, seconds rounded to 1 µs."""
    return {k: (round(after[k] - before[k], 6) if k.endswith("_seconds") else int(after[k] - before[k]))
            for k in keys if k in after and k in before}


def ttft_params(extra_args: dict | None = None):
    """The timed request's sampling: one greedy token."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra_args)


def timed_generate(engine, prompt, params):
    """(the RequestOutput, seconds): the wall time of ``generate`` of the one ``prompt``, after a
    garbage collection."""
    gc.collect()
    start = time.perf_counter()
    outputs = engine.generate([prompt], params, use_tqdm=False)  # vllm.LLM's and GraphChunkLLM's signature
    return outputs[0], time.perf_counter() - start


# --- statistics ---------------------------------------------------------------------------------

def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation); None without values."""
    arr = np.asarray(values, dtype=float)
    return float(np.percentile(arr, q)) if arr.size else None


def percentiles(values) -> dict:
    arr = np.asarray(values, dtype=float)
    return dict(p50=float(np.percentile(arr, 50)), p90=float(np.percentile(arr, 90)), mean=float(arr.mean()),
                min=float(arr.min()), max=float(arr.max()), n=int(arr.size))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, side by side; None where either is missing or b is 0."""
    return a / b if a is not None and b else None


# --- results ------------------------------------------------------------------------------------

def device_name() -> str:
    model = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} ({cores} cores)"


def git_state(*paths: str) -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether ``paths`` — the whole tree when none — have uncommitted changes)."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", *paths],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, dirty


def versions() -> dict:
    import torch
    import vllm

    from perf.common.freshness import code_digest

    commit, dirty = git_state("graphchunk")
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU", "OMP_", "KMP_", "LD_PRELOAD"))}
    return dict(python=sys.version.split()[0], torch=torch.__version__, vllm=vllm.__version__,
                graphchunk_commit=commit, graphchunk_dirty=dirty, graphchunk_code=code_digest(), env=env)


class RunClock:
    """A run's start, the load averages at its named points, and its environment record."""

    def __init__(self):
        self.started = time.time()
        self.load = {"start": os.getloadavg()}

    def mark(self, name: str) -> None:
        self.load[name] = os.getloadavg()

    def environment(self) -> dict:
        return {**versions(), "load_average": self.load,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
                "wall_s": time.time() - self.started}


def parse_with_quick(parser, argv, quick: dict):
    """``parser``'s arguments with a ``--quick`` flag: a smoke run at the sizes of ``quick``
    ({dest: value}), where sizes given explicitly still win."""
    parser.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(
        f"{k} {v}" for k, v in quick.items()) + " (explicitly given sizes still win)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    if args.quick:
        given = {a.split("=")[0] for a in raw if a.startswith("--")}
        for name, value in quick.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    return args


def int_pair(text: str) -> tuple[int, int]:
    """An argparse type: ``LO,HI`` (or one number for both) with 1 <= LO <= HI."""
    import argparse

    lo, _, hi = text.partition(",")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def config_dict(args, skip=()) -> dict:
    """The parsed arguments as JSON (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


def command_line(script: str, argv=None) -> str:
    """How to run this again from the repository root (``python -m perf.GROUP.SCRIPT``)."""
    module = ".".join(Path(os.path.relpath(script, REPO)).with_suffix("").parts)
    return shlex.join([".venv/bin/python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def write_json(path: Path | str, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


# --- plots --------------------------------------------------------------------------------------

def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path | str) -> None:
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
