"""KV layout probe and slot copies against vLLM's CPU attention KV-write kernel."""
import numpy as np
import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm.v1.kv_cache_layout import KVCacheLayout

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


# --- a copy split in two: read_slots out, write_slots in (the host tier's payload) -----------------

SLOT_CASES = [(backend, layout, dtype) for backend, layout in
              [("flash", x.name) for x in KVCacheLayout] + [("cpu", "LBHNC"), ("cpu", "one-buffer"),
                                                            ("cpu", "per-layer"), ("ascend", "pairs")]
              for dtype in (torch.float32, torch.bfloat16)]
SLOT_IDS = [f"{backend}-{layout}-{str(dtype).removeprefix('torch.')}" for backend, layout, dtype in SLOT_CASES]
PATHS = ["strided", "indexed", "gather", "gather-elements"]  # as test_kv_layouts.copier_for takes them


def filled_copier(backend, layout, dtype, path, seed=4):
    """Caches of a layout the tests build (test_kv_layouts': vLLM's six ``KVCacheLayout``s with the
    flash write, LBHNC with the CPU kernel, vllm-ascend's pairs; this module's one-buffer and
    per-layer CPU caches), random K/V written at every slot through the backend's op, the K/V
    written ([layers, slots, heads, head_size] each), and the runner's copier on ``path``."""
    import test_kv_layouts as kl

    if backend == "ascend":
        caches, keys, values = kl.ascend_filled(dtype, seed)
        return caches, keys, values, kl.ascend_copier(caches, path)
    if layout in ("one-buffer", "per-layer"):
        caches, keys, values = kl.written(layer_caches(dtype, layout == "one-buffer"), write(dtype), dtype, seed)
    else:
        caches, keys, values = kl.filled(KVCacheLayout[layout], backend, dtype, seed)
    return caches, keys, values, kl.copier_for(caches, backend, dtype, path)


def tensors(caches) -> list[torch.Tensor]:
    return [t for c in caches for t in ((c,) if isinstance(c, torch.Tensor) else c)]


def scattered_slots():
    """Disjoint src and dst (as pool and request slots are) of 6 blocks, in no order, each with one
    run that crosses a block edge at an offset the other's does not (28..36 -> 60..68)."""
    rest = np.random.default_rng(0).permutation(np.setdiff1d(np.arange(6 * BS), np.r_[28:37, 60:69]))
    return np.r_[rest[:10], 28:37, rest[10:20]], np.r_[rest[20:30], 60:69, rest[30:40]]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend,layout,dtype", SLOT_CASES, ids=SLOT_IDS)
def test_slots_read_then_written_equal_a_slot_copy(backend, layout, dtype, path):
    """``write_slots(read_slots(src), dst, key)`` leaves every cache bit for bit as ``copy_slots(src,
    dst)`` (key None), ``copy_slots(src, dst, key_temperature=t)`` (key: K / t) and
    ``copy_slots_rotated(src, dst, deltas, rotation)`` (key: the rotation) leave a second copy of the
    caches; the payload is [layers, 2, n, heads, head_size]."""
    from test_kv_layouts import rotation

    src, dst = scattered_slots()
    deltas = (np.arange(len(src)) % 7 + 190) * np.where(np.arange(len(src)) % 2, -1, 1)
    moves = [(None, lambda c: c.copy_slots(src, dst)),
             (lambda k: k / 0.7, lambda c: c.copy_slots(src, dst, key_temperature=0.7)),
             (lambda k: rotation().rotate(k, torch.from_numpy(deltas)),
              lambda c: c.copy_slots_rotated(src, dst, deltas, rotation()))]
    for key, copy in moves:
        got, _, _, copier = filled_copier(backend, layout, dtype, path)
        want, _, _, reference = filled_copier(backend, layout, dtype, path)
        before = [t.clone() for t in tensors(got)]
        payload = copier.read_slots(src)
        assert list(payload.shape) == [LAYERS, 2, len(src), HEADS, DIM]
        copier.write_slots(payload, dst, key)
        copy(reference)
        assert all(torch.equal(g, w) for g, w in zip(tensors(got), tensors(want), strict=True))
        assert not all(torch.equal(g, b) for g, b in zip(tensors(got), before)), "the slots did move"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend,layout,dtype", SLOT_CASES, ids=SLOT_IDS)
def test_read_slots_are_the_kv_written(backend, layout, dtype, path):
    """``read_slots`` gives, contiguous and a copy, the K and V the backend's op wrote at each slot;
    on the flash layouts the logical view's ``cache[block, head, offset, :D]`` (K) and ``[.., D:]``
    (V), on vllm-ascend's pairs ``k_cache[block, offset]`` and ``v_cache[block, offset]``."""
    src, _ = scattered_slots()
    caches, keys, values, copier = filled_copier(backend, layout, dtype, path)
    payload = copier.read_slots(src)
    assert payload.is_contiguous() and payload.dtype == dtype and payload.device == copier.device
    assert torch.equal(payload, torch.stack([keys[:, src], values[:, src]], 1))
    blocks, offsets = torch.from_numpy(src // BS), torch.from_numpy(src % BS)
    for layer, cache in enumerate(caches):
        if backend == "flash":
            logical = cache[blocks, :, offsets]  # [n, heads, 2 * head_size]
            assert torch.equal(payload[layer, 0], logical[..., :DIM])
            assert torch.equal(payload[layer, 1], logical[..., DIM:])
        elif backend == "ascend":
            assert torch.equal(payload[layer, 0], cache[0][blocks, offsets])
            assert torch.equal(payload[layer, 1], cache[1][blocks, offsets])
    payload.zero_()
    assert torch.equal(copier.read_slots(src), torch.stack([keys[:, src], values[:, src]], 1)), "a copy"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend,layout,dtype", SLOT_CASES, ids=SLOT_IDS)
def test_no_slots_read_or_written(backend, layout, dtype, path):
    """No slots: an empty payload [layers, 2, 0, heads, head_size], and writing one changes nothing."""
    caches, _, _, copier = filled_copier(backend, layout, dtype, path)
    before = [t.clone() for t in tensors(caches)]
    none = np.array([], np.int64)
    payload = copier.read_slots(none)
    assert list(payload.shape) == [LAYERS, 2, 0, HEADS, DIM] and payload.dtype == dtype
    copier.write_slots(payload, none)
    copier.write_slots(payload, none, key=lambda k: k / 0.7)
    assert all(torch.equal(t, b) for t, b in zip(tensors(caches), before, strict=True))
