"""Pseudo-sequence prefills under vLLM's compilation (``engine/runner_kv.py``).

vLLM compiles the model once and drops dynamo's guards (``vllm/compilation/wrapper.py``): a
compiled forward runs what was traced, whatever the decoder's layer range says at run time. So
CacheBlend's check pass (the first ``check_layer + 1`` layers only) must run past the compiled
graph, and must write KV into exactly those layers — checked on the session engine, compiled as a
user runs it (no --enforce-eager). The forward context a pseudo-sequence forward sets is checked
against the one vLLM's runner sets (its padding mask on the runner's device).
"""
from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest
import torch

from graphchunk.engine.runner_kv import RunnerKV

SENTINEL = 7.0


def _probe_forward_writes(worker, token_ids: list[int], num_layers: int | None) -> dict:
    """Runs in the engine's worker between steps: one pseudo-sequence forward over borrowed pool
    blocks filled with a sentinel (their KV restored afterwards); per layer, whether the forward
    wrote KV there."""
    import numpy as np
    import torch
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    from graphchunk.device import PseudoSeq

    runner = worker.model_runner
    pool, kv = runner.chunk_engine.pool, runner.chunk_engine.kv  # the pool's geometry; its index is the scheduler's
    needed = -(-len(token_ids) // pool.block_size)
    blocks = list(range(pool.first_block + pool.num_blocks - needed, pool.first_block + pool.num_blocks))
    saved = kv.read_blocks(blocks)  # the pool's last blocks, put back as they were: no entry loses its KV
    try:
        kv.write_blocks(blocks, torch.full_like(saved, SENTINEL))
        compiles = (compilation_counter.num_backend_compilations, counters["frames"]["total"])
        with torch.inference_mode():
            kv.prefill([PseudoSeq(token_ids, np.arange(len(token_ids)), blocks, 0)], num_layers=num_layers)
        after = kv.read_blocks(blocks)  # [layers, blocks, *one block]
        written = [bool((layer != SENTINEL).any()) for layer in after]
        untouched = [bool((layer == SENTINEL).all()) for layer in after]
        recompiled = (compilation_counter.num_backend_compilations, counters["frames"]["total"]) != compiles
    finally:
        kv.write_blocks(blocks, saved)
    return {"written": written, "untouched": untouched, "recompiled": recompiled,
            "compilation_mode": str(runner.compilation_config.mode)}


def run_in_worker(llm, fn, *args):
    """``fn(worker, *args)`` in the engine's worker (vLLM pickles it there: ``conftest`` allows it)."""
    module = sys.modules[__name__]  # a test module the engine's processes cannot import: send fn by value
    cloudpickle.register_pickle_by_value(module)
    try:
        return llm.llm.collective_rpc(fn, args=args)[0]
    finally:
        cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.slow
def test_check_pass_writes_only_its_layers_under_vllm_compilation(gc_llm, tokenizer):
    """CacheBlend's check pass over some slots: layers [0, check_layer] get fresh KV, the layers
    above keep what was there (blend keeps the reused KV there for tokens it does not pick); an
    ordinary pseudo-sequence forward still writes every layer; neither compiles anything anew."""
    check_layer = gc_llm.config.check_layer
    ids = tokenizer("The check pass of CacheBlend runs the first layers over every chunk token, "
                    "and only those layers; the reused keys and values above it stay.")["input_ids"] * 2
    assert len(ids) > 32  # more than one block
    # The first plain forward in a process compiles one small frame of vLLM's (5 ops, once: measured
    # with dynamo's counters); the assertion is that no check pass compiles anything after that.
    run_in_worker(gc_llm, _probe_forward_writes, ids, check_layer + 1)
    probe = run_in_worker(gc_llm, _probe_forward_writes, ids, check_layer + 1)
    assert probe["compilation_mode"] != "CompilationMode.NONE", "the engine must run vLLM's compiled forward"
    num_layers = len(probe["written"])
    assert num_layers > check_layer + 1
    assert probe["written"] == [True] * (check_layer + 1) + [False] * (num_layers - check_layer - 1), \
        f"check pass through {check_layer + 1} layers wrote KV in layers {np.flatnonzero(probe['written']).tolist()}"
    assert all(probe["untouched"][check_layer + 1:])
    assert not probe["recompiled"]
    full = run_in_worker(gc_llm, _probe_forward_writes, ids, None)
    assert full["written"] == [True] * num_layers and not full["recompiled"]


# --- the forward context of a pseudo-sequence forward, without an engine --------------------------

class _Decoder(torch.nn.Module):
    """A decoder stack that records the forward context and the layer range it runs under."""

    def __init__(self, num_layers: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        self.start_layer, self.end_layer = 0, num_layers
        self.seen: list[dict] = []

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        self.seen.append({"is_padding": context.is_padding, "skip_compiled": context.skip_compiled,
                          "cudagraph_runtime_mode": context.cudagraph_runtime_mode,
                          "end_layer": self.end_layer, "num_tokens": input_ids.shape[0]})


class _Runner:
    """The attributes ``RunnerKV.prefill`` reads from vLLM's model runner."""

    def __init__(self, device: str, max_num_tokens: int = 64):
        from types import SimpleNamespace

        from vllm.config import VllmConfig

        self.device = torch.device(device)
        self.vllm_config = VllmConfig()
        self.cache_config = SimpleNamespace(block_size=4)
        self.attn_groups = [[SimpleNamespace(layer_names=["layers.0.attn"], build_metadata=lambda common: common)]]
        self.model = _Decoder()
        # vLLM's persistent padding mask, left by a padded step as vLLM leaves it: padding rows True.
        self.is_padding = torch.ones(max_num_tokens, dtype=torch.bool, device=self.device)

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    _prepare_padding_mask = GPUModelRunner._prepare_padding_mask


def _seqs():
    from graphchunk.device import PseudoSeq

    return [PseudoSeq(list(range(10)), np.arange(10), [0, 1, 2], 3), PseudoSeq(list(range(5)), np.arange(5), [3, 4], 0)]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_padding_mask_is_the_runners_device_mask(device):
    """MoE routing (``VLLM_MOE_SKIP_PADDING``, on by default) indexes the forward context's
    ``is_padding`` with a device op: like vLLM's runner, the pseudo-sequence forward passes a bool
    mask on the runner's device over its tokens (none is padding). ``meta`` stands for an
    accelerator: a host mask there is the bug this catches."""
    runner = _Runner(device)
    RunnerKV(runner, None, None, []).prefill(_seqs())
    mask = runner.model.seen[-1]["is_padding"]
    assert mask.device == runner.device and mask.dtype == torch.bool and mask.shape == (12,)
    if device == "cpu":
        assert not mask.any()


def test_only_the_check_pass_runs_past_the_compiled_graph():
    """A narrowed layer range runs vLLM's plain forward (``skip_compiled``: the compiled graph would
    run every layer) and never a captured graph; full pseudo-sequence forwards keep the compiled one."""
    from vllm.config import CUDAGraphMode

    runner = _Runner("cpu")
    RunnerKV(runner, None, None, []).prefill(_seqs())
    RunnerKV(runner, None, None, []).prefill(_seqs(), num_layers=2)
    full, check = runner.model.seen
    assert (full["skip_compiled"], full["end_layer"]) == (False, 4)
    assert (check["skip_compiled"], check["end_layer"]) == (True, 2)
    assert full["cudagraph_runtime_mode"] == check["cudagraph_runtime_mode"] == CUDAGraphMode.NONE
    assert runner.model.end_layer == 4


# --- the question-aware scoring pass -------------------------------------------------------------

def _score_both_ways(worker, token_ids: list[int], num_cached: int) -> dict:
    """Runs in the engine's worker: the scoring pass through the compiled graph (full depth) and
    through vLLM's plain forward (every layer named, so ``skip_compiled``), over borrowed pool blocks."""
    import numpy as np
    import torch
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    from graphchunk.device import PseudoSeq

    runner = worker.model_runner
    pool, kv = runner.chunk_engine.pool, runner.chunk_engine.kv
    needed = -(-len(token_ids) // pool.block_size)
    blocks = list(range(pool.first_block + pool.num_blocks - needed, pool.first_block + pool.num_blocks))
    saved = kv.read_blocks(blocks)
    try:
        with torch.inference_mode():
            kv.prefill([PseudoSeq(token_ids[:num_cached], np.arange(num_cached), blocks, 0)])
            question = PseudoSeq(token_ids, np.arange(len(token_ids)), blocks, num_cached)
            plain = kv.context_attention([question], num_layers=len(kv.layers))[0]
            compiles = (compilation_counter.num_backend_compilations, counters["frames"]["total"])
            compiled = kv.context_attention([question])[0]
            recompiled = (compilation_counter.num_backend_compilations, counters["frames"]["total"]) != compiles
        patched = [layer for layer in kv.layers if "forward" in vars(layer.impl)]
    finally:
        kv.write_blocks(blocks, saved)
    return {"plain": plain.cpu().numpy(), "compiled": compiled.cpu().numpy(), "recompiled": recompiled,
            "left_patched": len(patched)}


@pytest.mark.slow
def test_scoring_pass_records_every_layer_from_the_compiled_graph(gc_llm, tokenizer):
    """The full-depth scoring pass runs vLLM's compiled graph and records each layer's query where
    the attention op hands it to the backend: its attention to the context equals the plain
    forward's (where every layer is named, so the graph is bypassed), nothing compiles anew, and no
    backend is left wrapped."""
    ids = tokenizer("Reused context that the question attends to, with enough tokens to fill a block "
                    "or two of the pool; then a short question about it?")["input_ids"] * 3
    num_cached = len(ids) - 9
    found = run_in_worker(gc_llm, _score_both_ways, ids, num_cached)
    assert found["plain"].shape == (num_cached,)
    np.testing.assert_allclose(found["compiled"], found["plain"], rtol=1e-3, atol=1e-3)
    assert not found["recompiled"] and found["left_patched"] == 0


def test_attention_to_cached_is_each_layers_softmax_summed(monkeypatch):
    """``_attention_to_cached`` in layer groups (a small group bound forces several) equals, per
    layer, the softmax of the scaled query-key products over grouped heads, causal among the
    question tokens, summed on the cached keys."""
    from types import SimpleNamespace

    from graphchunk.engine import runner_kv

    torch.manual_seed(0)
    n, heads, kv_heads, dim, num_cached, num_layers = 3, 4, 2, 8, 7, 5
    layers = [SimpleNamespace(num_heads=heads, head_size=dim, impl=SimpleNamespace(scale=0.2 + 0.1 * i))
              for i in range(num_layers)]
    queries = [torch.randn(n, heads, dim) for _ in layers]
    keys = [torch.randn(num_cached + n, kv_heads, dim) for _ in layers]
    expected = torch.zeros(num_cached)
    for layer, q, k in zip(layers, queries, keys):
        for h in range(heads):
            logits = q[:, h] @ k[:, h // (heads // kv_heads)].T * layer.impl.scale  # [n, keys]
            for i in range(n):
                expected += logits[i, :num_cached + i + 1].softmax(-1)[:num_cached]
    monkeypatch.setattr(runner_kv, "_SCORE_ELEMENTS", 2 * heads * n * (num_cached + n))
    got = runner_kv._attention_to_cached(queries, keys, num_cached, layers)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_recording_queries_restores_each_backend_as_it_was():
    """The pass wraps each layer's backend ``forward`` (one wrapper per backend, even one shared by
    two layers) and leaves it as it found it: the class's method, or an instance's own forward."""
    from types import SimpleNamespace

    from graphchunk.engine.runner_kv import _recording_queries

    class Impl:
        def forward(self, layer, query, *args, **kwargs):
            return "class"

    shared, patched = Impl(), Impl()
    patched.forward = lambda layer, query, *args, **kwargs: "own"
    layers = [SimpleNamespace(impl=shared), SimpleNamespace(impl=shared), SimpleNamespace(impl=patched)]
    queries: dict = {}
    with _recording_queries(layers, queries):
        outs = [layer.impl.forward(layer, torch.full((1,), float(i))) for i, layer in enumerate(layers)]
    assert outs == ["class", "class", "own"] and sorted(queries) == [0, 1, 2]
    assert [float(queries[i][0]) for i in range(3)] == [0.0, 1.0, 2.0]
    assert "forward" not in vars(shared) and patched.forward(None, None) == "own"
