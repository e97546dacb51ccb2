"""Shared fixtures. Models are provisioned once into $GRAPHCHUNK_HOME (default ~/.cache/graphchunk)."""
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests may run a function inside the session engine's worker (``llm.llm.collective_rpc(fn)``, as
# vLLM's own tests do); vLLM carries a callable between its processes only with this set.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# This process's OpenMP threads (torch's libgomp, which reads the variable when torch loads it)
# wait at a barrier asleep, not spinning: the suite's processes share two cores, and a thread
# spinning while its partner waits for a core an engine's start holds made the HF oracle ~3x slower
# (docs/getting-started.md, the suite's paragraph). Engines keep OpenMP's default, as a user's run:
# the variable is put back once torch is loaded. Waiting changes no result.
_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
if _OMP_WAIT_POLICY is None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

if _OMP_WAIT_POLICY is None:
    del os.environ["OMP_WAIT_POLICY"]

import engines  # noqa: E402

from graphchunk.reference import models  # noqa: E402
from graphchunk.reference.oracle import Oracle  # noqa: E402


# --- models -------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_path():
    return models.smollm2_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """The SmolLM2 tokenizer (the tiny checkpoints share it)."""
    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


# --- reference ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def oracle(smollm2_path):
    """Isolated-mode reference on SmolLM2-135M in fp32."""
    return Oracle(smollm2_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def oracle_references():
    """Drops the module's oracle references (``exactness.reference``'s cache) afterwards. The oracle
    runs on this process's two threads: they wait at barriers asleep (``OMP_WAIT_POLICY`` above), so
    an engine's worker or start beside them no longer makes two threads slower than one."""
    from exactness import clear_references

    yield
    clear_references()


PRECISION_ENV = ("ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE", "VLLM_FLOAT32_MATMUL_PRECISION")
"""oneDNN's switches to compute fp32 in bf16 or tf32, read by every process, and vLLM's, which its
CPU worker passes to ``torch.set_float32_matmul_precision`` (engines inherit all three)."""


def fp32_precision() -> dict:
    """What decides the precision of fp32 matmuls in this process and the engines it starts."""
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "backends.fp32_precision": getattr(torch.backends, "fp32_precision", None),
            "mkldnn.fp32_precision": torch.backends.mkldnn.fp32_precision,
            "mkldnn.matmul.fp32_precision": torch.backends.mkldnn.matmul.fp32_precision,
            **{name: os.environ.get(name) for name in PRECISION_ENV}}


SESSION_PRECISION = fp32_precision()


@pytest.fixture(scope="module", autouse=True)
def full_fp32_precision(request):
    """Every module runs, and leaves, fp32 at full precision: the oracle here, engines' workers
    through the environment. Context KV at tf32's 10-bit mantissa moves the first token's
    logprobs by ~1e-3 (tests/test_pool_pressure.py pins it), the size of the one unexplained
    failure in the suite's history; this names the module that changed the precision instead."""
    p = SESSION_PRECISION
    reduced = (p["float32_matmul_precision"] != "highest" or p["ONEDNN_DEFAULT_FPMATH_MODE"]
               or p["DNNL_DEFAULT_FPMATH_MODE"]
               or (p["VLLM_FLOAT32_MATMUL_PRECISION"] or "highest").lower() != "highest")
    assert not reduced, f"the session starts at reduced fp32 precision: {SESSION_PRECISION}"
    assert fp32_precision() == SESSION_PRECISION, f"fp32 precision changed before {request.module.__name__}"
    yield
    assert fp32_precision() == SESSION_PRECISION, f"{request.module.__name__} changed fp32 precision"


# --- real text ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def paragraphs():
    """Paragraphs of CPython's help topics (``graphchunk.reference.text``)."""
    from graphchunk.reference.text import help_paragraphs

    return help_paragraphs()


# --- vLLM's scheduler with graphchunk's connector, without a model (``schedule_harness``) ---------

@pytest.fixture(scope="module")
def vllm_scheduler(smollm2_path):
    """``make(asynchronous=False, **graphchunk_settings)``: vLLM's Scheduler (or AsyncScheduler) with
    graphchunk's connector and the harness's geometry (``schedule_harness.make_vllm_scheduler``)."""
    from graphchunk.engine import plugin
    from schedule_harness import GC, make_vllm_scheduler

    plugin.register()
    return lambda asynchronous=False, **gc: make_vllm_scheduler(smollm2_path, {**GC, **gc}, asynchronous)


# --- engine -------------------------------------------------------------------------------------

GC_LLM_BLOCK_SIZE = 32
"""vLLM's CPU attention needs a multiple of 32; small blocks put block boundaries inside chunks."""
GC_LLM_MAX_BATCHED_TOKENS = 256
"""Prompts longer than this run as several chunked-prefill steps; shorter ones in one."""
GC_LLM_TEMPLATES = Path(__file__).parent / "data" / "templates.toml"
"""The bucket grid counting how each cached-chunk prefill ran on vLLM's compiled graph."""


def build_gc_llm():
    """One GraphChunkLLM engine (SmolLM2-135M, fp32, prefix caching on, vLLM's own compilation on
    as a user gets it — no --enforce-eager — with the test grid's buckets counted) for the whole
    session (``gc_llm``); starting one takes ~1.5 min of vLLM's compile on a cold inductor cache."""
    from graphchunk import GraphChunkLLM

    return GraphChunkLLM(str(models.smollm2_path()), dtype="float32", max_model_len=2048,
                         gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 << 30,
                         max_num_batched_tokens=GC_LLM_MAX_BATCHED_TOKENS, block_size=GC_LLM_BLOCK_SIZE,
                         enable_prefix_caching=True,
                         graphchunk={"pool_tokens": 8192, "templates": str(GC_LLM_TEMPLATES), "mode": "isolated",
                                     "separator": "##"})  # its tests send the seeds' form


gc_llm = engines.fixture(build_gc_llm, "gc_llm", scope="session")


@pytest.fixture(scope="session", autouse=True)
def engines_closed():
    """Every engine closed before the session ends (``engines.finish``; torn down last)."""
    yield
    engines.finish()


def pytest_runtest_setup(item):
    engines.start_next(item)


# --- the record of every difference from the oracle (``--record-differences FILE``) ---------------

def pytest_addoption(parser):
    parser.addoption("--record-differences", metavar="FILE", default=None,
                     help="append each test's largest first-token and all-token logprob difference from its "
                          "oracle to FILE, one line per test that compared any (exactness.RECORDED)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """With ``--record-differences``: every comparison of the test's call, its maxima written, so a
    run's history names any test that moved."""
    path = item.config.getoption("--record-differences")
    if not path:
        yield
        return
    import exactness

    exactness.RECORDED = []
    try:
        yield
    finally:
        found, exactness.RECORDED = exactness.RECORDED, None
        if found:
            first = max((diff for step, diff in found if step == 0), default=0.0)
            with open(path, "a") as f:
                f.write(f"{item.nodeid}\tfirst token {first:.2e}\tall tokens {max(d for _, d in found):.2e}"
                        f"\tcompared {len(found)}\n")
