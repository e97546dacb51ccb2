"""graphchunk against vllm-ascend's own source (``graphchunk.contract.ascend.COMMIT``, main of
2026-08-22, paired with vLLM 0.27.1), on CPU: no NPU, no vllm-ascend installed.

What is handled is checked with stand-ins built from that source: ``NPUModelRunner``'s
one-argument ``initialize_kv_cache`` (fake base classes of each signature); the layout step on a
layer whose cache is a ``(k_cache, v_cache)`` pair and whose write op keeps the first caches it is
handed, as ``AscendAttentionBackendImpl.do_kv_cache_update`` does (``kv_binding.kv_layout``: no
scratch ever reaches it); pool sizing at vllm-ascend's default block size, 128. What is not
(the chunk forward's metadata, forward context and rotary tables; the missing vLLM pairing) is
refused at start-up: the message is checked, and every vllm-ascend name graphchunk relies on or
names holds against the record of that commit. The seventh KV layout's copies are in
``tests/test_kv_layouts.py``.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from graphchunk.cache.kv_slots import KVCopier
from graphchunk.compat import RELEASES
from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.contract import ascend, check
from graphchunk.contract.names import Name
from graphchunk.engine import model_runner, worker
from graphchunk.engine.kv_binding import kv_layout
from test_kv_layouts import BLOCKS, BS, DIM, HEADS, ascend_caches, write_ascend

# --- the recorded contract ------------------------------------------------------------------------


def test_every_ascend_entry_holds_against_the_record_of_the_commit_read():
    resolver = ascend.AscendRecordResolver()
    assert resolver.commit == ascend.COMMIT
    assert json.loads(ascend.RECORD.read_text())["paired_vllm"] == ascend.PAIRED_VLLM == "0.27.1"
    results = check.check(resolver, ascend.NAMES)
    assert len(results) == len(ascend.NAMES) >= 10
    failed = [check.line(r) for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for entry in ascend.NAMES:
        assert entry.module.startswith("vllm_ascend."), entry


def test_the_record_answers_graphchunks_old_assumptions_with_a_failure():
    """What graphchunk assumed before reading vllm-ascend: a three-argument initialize_kv_cache."""
    old = Name(ascend.RUNNER, "NPUModelRunner.initialize_kv_cache", "override", ascend.MR,
               params=("kv_cache_config", "is_profiling", "kv_cache_allocation_context"))
    result = check.check_entry(old, ascend.AscendRecordResolver())
    assert not result.ok and "(kv_cache_config)" in result.reason


def test_the_refusal_names_only_what_the_record_holds():
    message = worker.ascend_refusal()
    for entry in ascend.NAMES:
        if entry.used_in == ascend.WK and entry.kind in ("field", "import"):
            assert entry.qualname.split(".")[-1] in message, entry.qualname


# --- the start-up refusal -------------------------------------------------------------------------


def test_ascend_is_refused_at_start_up_naming_what_is_missing(monkeypatch):
    import vllm.platforms

    npu = SimpleNamespace(is_cpu=lambda: False, is_cuda_alike=lambda: False, device_name="npu")
    monkeypatch.setattr(vllm.platforms, "current_platform", npu)
    with pytest.raises(ConfigError) as refused:
        worker.platform_worker_class()
    message = str(refused.value)
    for needed in ("AscendCommonAttentionMetadata", "attn_state", "actual_seq_lengths_q",
                   "set_ascend_forward_context", "update_cos_sin(positions)", "graphchunk/engine/runner_kv.py",
                   "no vllm-ascend release pairs with a vLLM graphchunk admits", "vllm-ascend 0.30.0",
                   "docs/gpu.md"):
        assert needed in message, needed
    assert ", ".join(RELEASES) in message


# --- initialize_kv_cache of each signature -----------------------------------------------------------


class VLLMRunner:
    """vLLM 0.32's runners: ``(kv_cache_config, is_profiling, kv_cache_allocation_context)``."""

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None):
        self.called = (kv_cache_config, is_profiling, kv_cache_allocation_context)


class NPURunner:
    """vllm-ascend's ``NPUModelRunner.initialize_kv_cache(self, kv_cache_config)``."""

    def initialize_kv_cache(self, kv_cache_config):
        self.called = (kv_cache_config,)


def chunk_runner(base, monkeypatch):
    grown = SimpleNamespace(num_blocks=120)
    monkeypatch.setattr(model_runner, "grown_kv_cache_config", lambda vllm_config, config, extra: grown)
    monkeypatch.setattr(model_runner, "bind_engine", lambda runner, config, first: ("engine", first))
    runner = model_runner.chunk_runner_class(base)()
    runner.graphchunk_setup(GraphChunkConfig(pool_tokens=2560))
    runner.cache_config, runner.vllm_config = SimpleNamespace(block_size=128, num_gpu_blocks=None), None
    return runner, grown


@pytest.mark.parametrize("base", [VLLMRunner, NPURunner])
def test_initialize_kv_cache_calls_the_base_with_what_it_takes(base, monkeypatch):
    runner, grown = chunk_runner(base, monkeypatch)
    config = SimpleNamespace(num_blocks=100)
    runner.initialize_kv_cache(config)
    assert runner.called == ((grown, False, None) if base is VLLMRunner else (grown,))
    assert runner.chunk_engine == ("engine", 100) and runner.cache_config.num_gpu_blocks == 120


def test_a_profiling_call_reaches_vllms_runner_and_a_value_the_base_cannot_take_is_an_error(monkeypatch):
    runner, _ = chunk_runner(VLLMRunner, monkeypatch)
    context = object()
    runner.initialize_kv_cache("config", True, context)
    assert runner.called == ("config", True, context) and runner.chunk_engine is None
    npu, _ = chunk_runner(NPURunner, monkeypatch)
    with pytest.raises(TypeError, match="takes no is_profiling"):
        npu.initialize_kv_cache("config", is_profiling=True)


# --- the layout step never hands a scratch to a write op that keeps it ---------------------------------


class AscendStyleImpl:
    """``AscendAttentionBackendImpl.do_kv_cache_update`` in torch: it keeps the caches of its first
    call as the layer's (``self.key_cache``) and writes there from then on, whatever it is handed."""

    def __init__(self, bound=None):
        self.key_cache, self.value_cache = bound if bound is not None else (None, None)
        self.handed = []

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self.key_cache is None:
            self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
        self.handed.append(kv_cache)
        write_ascend(key, value, (self.key_cache, self.value_cache), slot_mapping)


SPEC = SimpleNamespace(block_size=BS, num_kv_heads=HEADS, head_size=DIM)


def filled_pair():
    pair = ascend_caches(torch.float32)[0]
    for t in pair:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(7)))
    return pair


def test_the_layout_step_binds_the_layers_own_pair_and_leaves_it_unchanged():
    pair = filled_pair()
    before = [t.clone() for t in pair]
    layer = SimpleNamespace(kv_cache=pair, impl=AscendStyleImpl())
    block_dim, slot_map = kv_layout(layer, SPEC, BLOCKS)
    assert block_dim == 0 and slot_map.split
    assert layer.impl.key_cache is pair[0] and layer.impl.value_cache is pair[1]
    assert layer.impl.handed and all(c is pair for c in layer.impl.handed), "only the real pair was handed to it"
    assert all(torch.equal(t, b) for t, b in zip(pair, before)), "the checked slot is restored"
    copier = KVCopier([pair], slot_map, BLOCKS, block_dim)
    assert torch.equal(copier.read_keys(0, [3, BS + 5]), pair[0][[0, 1], [3, 5]])


def test_a_write_op_already_bound_elsewhere_is_refused():
    """If the write op kept other caches (a scratch from an earlier call), the check on the real
    pair finds its write elsewhere and refuses instead of copying into caches nothing reads."""
    pair, elsewhere = filled_pair(), ascend_caches(torch.float32)[1]
    layer = SimpleNamespace(kv_cache=pair, impl=AscendStyleImpl(bound=elsewhere))
    with pytest.raises(RuntimeError, match="does not address the real KV cache"):
        kv_layout(layer, SPEC, BLOCKS)


@pytest.mark.parametrize("cache, message", [
    ((torch.zeros(BLOCKS, BS, HEADS, DIM),), "is 1 tensor"),
    ((torch.zeros(BLOCKS, BS, 1, 512), torch.zeros(BLOCKS, BS, 1, 64)), "different shapes or strides"),
    ((torch.zeros(BLOCKS, BS, HEADS + 1, DIM),) * 2, "expected K and V caches"),
])
def test_pairs_graphchunk_cannot_copy_are_refused(cache, message):
    layer = SimpleNamespace(kv_cache=cache, impl=AscendStyleImpl())
    with pytest.raises(ConfigError, match=message):
        kv_layout(layer, SPEC, BLOCKS)
    assert layer.impl.handed == [], "nothing written before the refusal"


# --- vllm-ascend's default block size, 128 ---------------------------------------------------------


def test_pool_sizing_at_block_size_128():
    """The pool's minimum is whole 128-token blocks (a sys prompt of max_model_len, one more block,
    one chunk of max_chunk_len), checked and refused in tokens at that block size."""
    from graphchunk.cache.pool import ChunkPool
    from test_worker_config import vllm_config

    config = vllm_config(block_size=128)
    assert worker.min_pool_blocks(config, GraphChunkConfig(max_chunk_len=512)) == 2048 // 128 + 1 + 512 // 128
    worker.check_config(config, GraphChunkConfig(pool_tokens=21 * 128 - 100, max_chunk_len=512))
    with pytest.raises(ConfigError, match="2688 tokens at block size 128"):
        worker.check_config(config, GraphChunkConfig(pool_tokens=20 * 128, max_chunk_len=512))
    pool = ChunkPool(num_blocks=4, block_size=128)
    entries = [pool.insert(i.to_bytes(16, "little"), (i,), n) for i, n in enumerate([20, 128, 129])]
    assert [len(e.block_ids) for e in entries] == [1, 1, 2] and pool.num_free_blocks == 0
    pool.check_invariants()
