"""KV layout probe and slot copies against vLLM's CPU attention KV-write kernel."""
import numpy as np
import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from graphchunk.cache.kv_slots import KVCopier, KVSlotMap
from graphchunk.device import consecutive_runs

BS, HEADS, DIM, BLOCKS, LAYERS = 32, 3, 64, 8, 4


def write(dtype):
    isa = _get_attn_isa(dtype, BS, DIM)

    def write_kv(key, value, cache, slots):
        blocks = cache.shape[0]
        k_cache, v_cache = cache.view(blocks, HEADS, 2 * BS, DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
    return write_kv


def cpu_slot_map(write_kv, dtype) -> KVSlotMap:
    return KVSlotMap.probe(write_kv, torch.zeros((BLOCKS, HEADS, BS, 2 * DIM), dtype=dtype), 0, BS, HEADS, DIM)


def layer_caches(dtype, shared: bool):
    shape = (BLOCKS, HEADS, BS, 2 * DIM)
    if shared:  # as vLLM allocates: one buffer, layer-outermost views
        buffer = torch.zeros((LAYERS, *shape), dtype=dtype)
        return [buffer[i] for i in range(LAYERS)]
    return [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("strided", [True, False, "gather"])
def test_copy_equals_writing_at_the_destination(dtype, shared, strided):
    write_kv = write(dtype)
    slot_map = cpu_slot_map(write_kv, dtype)
    isa = _get_attn_isa(dtype, BS, DIM)
    # vLLM's CPU layouts are affine (one stride per block, head, offset), except the packed tiles of its
    # AMX kernel (bf16 on CPUs with AMX): the probe maps every element, and copies take the gather path.
    assert (None not in slot_map.strides) == (isa != "amx"), f"{isa}: {slot_map.strides}"
    src = np.arange(70) + 1 * BS + 5  # crosses block boundaries at other offsets than dst
    dst = np.concatenate([np.arange(40) + 5 * BS + 17, np.arange(30) + 7 * BS + 1])  # disjoint from src, as pool and request slots are
    got, want = layer_caches(dtype, shared), layer_caches(dtype, shared)
    torch.manual_seed(0)
    for g, w in zip(got, want):
        key, value = torch.randn(70, HEADS, DIM).to(dtype), torch.randn(70, HEADS, DIM).to(dtype)
        write_kv(key, value, g, torch.from_numpy(src))
        write_kv(key, value, w, torch.from_numpy(src))
        write_kv(key, value, w, torch.from_numpy(dst))
    copier = KVCopier(got, slot_map, BLOCKS, gather=strided == "gather")
    assert (copier.layer_stride is not None) == shared
    if not strided:
        copier.views = None  # the flat-gather path used for non-affine layouts
    copier.copy_slots(src, dst)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_runs_split_at_breaks_and_block_edges():
    src = np.array([3, 4, 5, 6, 7, 20, 21])
    dst = np.array([10, 11, 12, 13, 14, 15, 16])
    assert consecutive_runs(src, dst, block_size=4) == [(3, 10, 1), (4, 11, 1), (5, 12, 3), (20, 15, 1), (21, 16, 1)]
    assert consecutive_runs(src[:0], dst[:0], block_size=4) == []
    with pytest.raises(ValueError):
        consecutive_runs(src, dst[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("strided", [True, False, "gather"])
def test_rotated_copy_equals_writing_rotated_keys_at_the_destination(dtype, shared, strided):
    """Blend mode's copy: K rotated by each slot's delta, V as is, in every layer; read_keys reads
    back what was written."""
    from graphchunk.blend.rope import KeyRotation

    write_kv = write(dtype)
    slot_map = cpu_slot_map(write_kv, dtype)
    angles = torch.arange(200.0)[:, None] * (1e-2 ** (torch.arange(0, DIM, 2) / DIM))[None]
    rotation = KeyRotation(torch.cat([angles.cos(), angles.sin()], dim=-1), DIM, is_neox_style=True)
    src, dst = np.arange(40) + 2 * BS + 3, np.arange(40) + 5 * BS + 9
    deltas = np.full(40, 137)
    got, want = layer_caches(dtype, shared), layer_caches(dtype, shared)
    torch.manual_seed(1)
    for g, w in zip(got, want):
        key, value = torch.randn(40, HEADS, DIM).to(dtype), torch.randn(40, HEADS, DIM).to(dtype)
        write_kv(key, value, g, torch.from_numpy(src))
        write_kv(key, value, w, torch.from_numpy(src))
        write_kv(rotation.rotate(key, torch.from_numpy(deltas)), value, w, torch.from_numpy(dst))
    copier = KVCopier(got, slot_map, BLOCKS, gather=strided == "gather")
    if not strided:
        copier.views = None
    copier.copy_slots_rotated(src, dst, deltas, rotation)
    for layer, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), layer
        written = KVCopier(want, slot_map, BLOCKS)
        assert torch.equal(copier.read_keys(layer, dst), written.read_keys(layer, dst))
    assert not torch.equal(copier.read_keys(0, dst), copier.read_keys(0, src)), "the keys did move"


@pytest.mark.parametrize("shared", [True, False])
def test_blocks_read_and_written_back_elsewhere_equal_a_block_copy(shared):
    """The persistent tier's payload: whole blocks of every layer out, and in at other blocks."""
    slot_map = cpu_slot_map(write(torch.bfloat16), torch.bfloat16)
    got, want = layer_caches(torch.bfloat16, shared), layer_caches(torch.bfloat16, shared)
    torch.manual_seed(1)
    for g, w in zip(got, want):
        g.copy_(torch.randn(g.shape))
        w.copy_(g)
    copier = KVCopier(got, slot_map, BLOCKS)
    data = copier.read_blocks([2, 5, 1])
    assert list(data.shape) == [LAYERS, 3, *copier.block_shape] and copier.block_shape == [HEADS, BS, 2 * DIM]
    copier.write_blocks([6, 0, 7], data)
    KVCopier(want, slot_map, BLOCKS).copy_blocks([2, 5, 1], [6, 0, 7])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
