"""KV layout conformance: graphchunk's slot copies, rotated copies, key reads and block moves on
caches built the way vLLM's worker builds them, in every ``KVCacheLayout``, checked by logical
indexing (DESIGN.md §7).

vLLM 0.32 views each layer's cache as logical ``[blocks, heads, block_size, 2 * head_size]`` (K in
the first half of the last axis); the physical order comes from the layout: the caches here come
from vLLM's own ``get_kv_cache_config_from_groups`` (strides by ``compute_layout_strides``) and
``allocate_kv_cache``, as in ``GPUModelRunner.initialize_kv_cache_tensors``. They are written
through a torch reference of each backend's KV-write op:

* ``flash``: ``reshape_and_cache_flash`` over ``kv_cache.transpose(1, 2).split(head_size, -1)``
  (``[B, N, H, D]`` views of K and V), the write of FlashAttention, FlashInfer (every KV dtype
  but NVFP4), FlexAttention and, as ``triton_reshape_and_cache_flash`` with the same contract,
  Triton attention (``gpu_style.write_flash``, the stand-in the FlexAttention engine test runs
  on); the reference is itself checked against the logical view below;
* ``cpu``: vLLM's CPU attention kernel itself (``cpu_attn_reshape_and_cache``, through
  ``test_kv_slots.write``), in the one layout the CPU backend accepts, LBHNC.

The caches come from ``gpu_style.vllm_caches``. The slot map comes from the code path the runner
uses (``KVSlotMap.probe`` on the real layer's cache, then ``verify`` on it), and the copier is the
runner's (``KVCopier``).

A seventh layout, vllm-ascend's (read at ``graphchunk.contract.ascend.COMMIT``): each layer's cache
is a pair ``(k_cache, v_cache)`` of separate tensors ``[blocks, block_size, heads, head_size]``,
built as ``NPUModelRunner`` builds them (``ascend_caches``) and written through a torch reference of
its write op (``write_ascend``); its map is ``KVSlotMap.of_split``, checked by ``verify``, as
``kv_binding.split_kv_layout`` does.
"""
import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

import gpu_style
from graphchunk.blend.rope import KeyRotation
from graphchunk.cache.kv_slots import KVCopier, KVSlotMap
from gpu_style import write_flash
from test_kv_slots import BS, DIM, HEADS, write as write_cpu

LAYERS, BLOCKS = 4, 6
DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = list(KVCacheLayout)


def vllm_caches(layout: KVCacheLayout, dtype) -> list[torch.Tensor]:
    return gpu_style.vllm_caches(layout, dtype, BLOCKS, BS, HEADS, DIM, LAYERS)


CASES = [(layout, "flash", dtype) for layout in LAYOUTS for dtype in DTYPES] + \
        [(KVCacheLayout.LBHNC, "cpu", dtype) for dtype in DTYPES]
IDS = [f"{layout.name}-{backend}-{str(dtype).removeprefix('torch.')}" for layout, backend, dtype in CASES]


def writer(backend: str, dtype):
    return write_flash if backend == "flash" else write_cpu(dtype)


def filled(layout, backend, dtype, seed: int):
    """vLLM's caches with random K/V written through the backend's op at every slot, and the K/V
    written ([layers, slots, heads, head_size] each)."""
    return written(vllm_caches(layout, dtype), writer(backend, dtype), dtype, seed)


def written(caches, write_kv, dtype, seed: int):
    """``caches`` with random K/V written through ``write_kv`` at every slot, and the K/V written."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.arange(BLOCKS * BS)
    keys, values = (torch.randn(LAYERS, len(slots), HEADS, DIM, generator=generator).to(dtype) for _ in range(2))
    for cache, key, value in zip(caches, keys, values):
        write_kv(key, value, cache, slots)
    return caches, keys, values


def copier_for(caches, backend, dtype, path: str = "strided") -> KVCopier:
    """The runner's path (``kv_binding.probe_kv_layout``): probe on layer 0's real cache, verify
    on its last slot, one copier over every layer, writing through the backend's op as the
    runner's does. ``path`` 'indexed' copies every slot with one gather and one scatter per view
    (the accelerators' path on affine layouts); 'gather' and 'gather-elements' take the path of
    layouts that are not affine (flat gathers), written through the backend's op or element by element."""
    write_kv = writer(backend, dtype)
    slot_map = KVSlotMap.probe(write_kv, caches[0], 0, BS, HEADS, DIM)
    slot_map.verify(write_kv, caches[0], BLOCKS * BS - 1)
    copier = KVCopier(caches, slot_map, BLOCKS, 0, writers=None if path == "gather-elements" else [write_kv] * LAYERS,
                      gather=path == "indexed")
    if path not in ("strided", "indexed"):
        copier.views = None
    return copier


def logical_keys(cache: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
    """K [n, heads, head_size] of ``slots`` by logical indexing (vLLM's contract for GPU backends)."""
    slots = torch.from_numpy(np.asarray(slots, np.int64))
    return cache[slots // BS, :, slots % BS, :DIM]


SRC = np.arange(70) + 1 * BS + 5                                                  # crosses blocks at offset 5
DST = np.concatenate([np.arange(40) + 3 * BS + 17, np.arange(30) + 5 * BS + 1])   # other offsets, disjoint


def rotation() -> KeyRotation:
    angles = torch.arange(300.0)[:, None] * (1e-2 ** (torch.arange(0, DIM, 2) / DIM))[None]
    return KeyRotation(torch.cat([angles.cos(), angles.sin()], dim=-1), DIM, is_neox_style=True)


def moved(layout, backend, dtype, caches, keys, values, deltas=None, key_temperature=1.0) -> list[torch.Tensor]:
    """Every layer as it must be after moving SRC's K/V to DST (K rotated by ``deltas``, or divided
    by ``key_temperature``): a copy of ``caches`` with the moved values written at DST through the
    backend's own op."""
    want = vllm_caches(layout, dtype)
    write_kv = writer(backend, dtype)
    for cache, target, key, value in zip(caches, want, keys, values):
        target.copy_(cache)
        key = key[SRC] if deltas is None else rotation().rotate(key[SRC], torch.from_numpy(deltas))
        key = key if key_temperature == 1 else key / key_temperature
        write_kv(key, value[SRC], target, torch.from_numpy(DST))
    return want


# --- the caches are what vLLM builds -----------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.name for x in LAYOUTS])
def test_vllm_allocates_the_layout_physically(layout):
    """The per-layer caches are strided views of one buffer in the layout's physical order: only
    LBHNC is what a contiguous stand-in would be."""
    caches = vllm_caches(layout, torch.float32)
    assert all(c.shape == (BLOCKS, HEADS, BS, 2 * DIM) for c in caches)
    assert len({c.untyped_storage().data_ptr() for c in caches}) == 1
    strides = caches[0].stride()
    physical = sorted(range(4), key=lambda d: -strides[d])  # logical [B, H, N, C] axes, outermost first
    assert tuple(physical) == layout.layer_view_order
    assert caches[0].is_contiguous() == (layout is KVCacheLayout.LBHNC)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.name for x in LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_write_reference_follows_the_logical_view(layout, dtype):
    """The reference write op puts token t's K at ``cache[block, head, offset, :D]`` and V at
    ``[..., D:]`` of the logical view, touching nothing else, whatever the physical order."""
    cache = vllm_caches(layout, dtype)[1]
    before = cache.clone()
    slots = torch.tensor([3, BS + 7, 4 * BS + 31, -1])
    key, value = torch.randn(4, HEADS, DIM).to(dtype), torch.randn(4, HEADS, DIM).to(dtype)
    write_flash(key, value, cache, slots)
    for t, slot in enumerate(slots.tolist()[:3]):
        assert torch.equal(cache[slot // BS, :, slot % BS, :DIM], key[t])
        assert torch.equal(cache[slot // BS, :, slot % BS, DIM:], value[t])
        before[slot // BS, :, slot % BS] = cache[slot // BS, :, slot % BS]
    assert torch.equal(cache, before), "only the written slots changed"


# --- graphchunk's copies ---------------------------------------------------------------------------

PATHS = ["strided", "indexed", "gather", "gather-elements"]


@pytest.mark.parametrize("key_temperature", [1.0, 0.7], ids=["plain", "temperature"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout,backend,dtype", CASES, ids=IDS)
def test_slot_copy(layout, backend, dtype, path, key_temperature):
    """``copy_slots`` (an isolated chunk placed at an offset that is not block-aligned) leaves every
    layer exactly as writing the source's K/V at the destination through the backend would (with
    isolated mode's key temperature: K divided by it, V as is)."""
    caches, keys, values = filled(layout, backend, dtype, seed=1)
    want = moved(layout, backend, dtype, caches, keys, values, key_temperature=key_temperature)
    copier = copier_for(caches, backend, dtype, path)
    copier.copy_slots(SRC, DST, key_temperature)
    for layer, (got, expected) in enumerate(zip(caches, want)):
        assert torch.equal(got, expected), f"layer {layer}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout,backend,dtype", CASES, ids=IDS)
def test_rotated_copy_and_key_reads(layout, backend, dtype, path):
    """Blend's copy: K rotated by each slot's delta, V as is, every layer; ``read_keys`` (CacheBlend's
    check) reads back the keys written, which on GPU layouts are the logical view's. Deltas of both
    signs: a chunk lands later than it was stored, or earlier (a capture rotates back to where its
    entry holds it; a chunk stored after the blend prefix lands before the prefix's length)."""
    deltas = (np.arange(70) % 7 + 190) * np.where(np.arange(70) % 2, -1, 1)
    caches, keys, values = filled(layout, backend, dtype, seed=2)
    want = moved(layout, backend, dtype, caches, keys, values, deltas)
    copier = copier_for(caches, backend, dtype, path)
    copier.copy_slots_rotated(SRC, DST, deltas, rotation())
    rotated = rotation().rotate(keys[:, SRC], torch.from_numpy(deltas))
    for layer, (got, expected) in enumerate(zip(caches, want)):
        assert torch.equal(got, expected), f"layer {layer}"
        assert torch.equal(copier.read_keys(layer, DST), rotated[layer])
        assert torch.equal(copier.read_keys(layer, SRC), keys[layer, SRC])
        if backend == "flash":
            assert torch.equal(logical_keys(got, DST), rotated[layer])


@pytest.mark.parametrize("layout,backend,dtype", CASES, ids=IDS)
def test_block_copy_and_tier_blocks(layout, backend, dtype):
    """Whole blocks (the sys prompt's partial last block, the tier's payload) move with every layer."""
    caches, _, _ = filled(layout, backend, dtype, seed=3)
    copier = copier_for(caches, backend, dtype)
    data = copier.read_blocks([2, 5])
    assert list(data.shape) == [LAYERS, 2, HEADS, BS, 2 * DIM]
    want = [c.clone() for c in caches]
    for w in want:
        w[[0, 3]] = w[[2, 5]]
    copier.write_blocks([0, 3], data)
    assert all(torch.equal(c, w) for c, w in zip(caches, want))
    for w in want:
        w[4] = w[1]
    copier.copy_blocks([1], [4])
    assert all(torch.equal(c, w) for c, w in zip(caches, want))


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x is not KVCacheLayout.LBHNC], ids=lambda x: x.name)
def test_a_map_probed_on_a_contiguous_stand_in_is_refused(layout):
    """What graphchunk did before: probing a contiguous scratch measures LBHNC offsets. On any other
    layout the check on the real cache refuses that map instead of copying the wrong elements."""
    caches = vllm_caches(layout, torch.float32)
    stand_in = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)
    wrong = KVSlotMap.probe(write_flash, stand_in, 0, BS, HEADS, DIM)
    with pytest.raises(RuntimeError, match="does not address the real KV cache"):
        wrong.verify(write_flash, caches[0], BLOCKS * BS - 1)
    right = KVSlotMap.probe(write_flash, caches[0], 0, BS, HEADS, DIM)
    assert (right.coords.tolist(), right.block_stride) != (wrong.coords.tolist(), wrong.block_stride)


# --- the seventh layout: vllm-ascend's separate K and V tensors ------------------------------------

def ascend_caches(dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(k_cache, v_cache)`` as vllm-ascend's ``NPUModelRunner`` builds them: per layer's
    ``KVCacheTensor`` (of ``num_blocks * page_size_bytes`` bytes, one per layer for one full-attention
    group), ``_allocate_kv_cache_tensors`` allocates K and V as two separate int8 buffers of
    ``size / calc_split_factor([head_size, head_size])`` (2 each) bytes; ``_reshape_kv_cache_tensors``
    views each as the KV dtype shaped ``AscendAttentionBackend.get_kv_cache_shape(num_blocks,
    ...)[1:]``, i.e. ``[blocks, block_size, heads, head_size]``, with ``num_blocks`` = (K bytes + V
    bytes) / the spec's page size."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)
    size = BLOCKS * spec.page_size_bytes  # KVCacheTensor.size
    caches = []
    for _ in range(LAYERS):
        split = [(DIM + DIM) / DIM] * 2  # calc_split_factor([k_dim, v_dim])
        k_raw, v_raw = (torch.zeros(int(size // factor), dtype=torch.int8) for factor in split)
        num_blocks = (k_raw.numel() + v_raw.numel()) // spec.page_size_bytes
        shape = (2, num_blocks, BS, HEADS, DIM)[1:]  # get_kv_cache_shape(...)[1:]
        caches.append((k_raw.view(dtype).view(shape), v_raw.view(dtype).view(shape)))
    return caches


def write_ascend(key, value, cache, slots):
    """Torch reference of vllm-ascend's KV write (``DeviceOperator.reshape_and_cache``:
    ``torch_npu.npu_scatter_pa_kv_cache`` in cache_mode 'Norm', ``_npu_reshape_and_cache`` on 310P):
    each token's K/V at ``[slot // block_size, slot % block_size]`` of the K / V cache."""
    k_cache, v_cache = cache
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = key
    v_cache[slots // bs, slots % bs] = value


def ascend_filled(dtype, seed: int):
    return written(ascend_caches(dtype), write_ascend, dtype, seed)


def ascend_copier(caches, path: str) -> KVCopier:
    """``kv_binding.split_kv_layout``'s map (strides, then ``verify`` through the write op on the last
    slot) and the runner's copier over the pairs."""
    slot_map = KVSlotMap.of_split(*caches[0])
    slot_map.verify(write_ascend, caches[0], BLOCKS * BS - 1)
    writers = None if path == "gather-elements" else [write_ascend] * LAYERS
    copier = KVCopier(caches, slot_map, BLOCKS, 0, writers=writers, gather=path == "indexed")
    if path not in ("strided", "indexed"):
        copier.views = None
    return copier


def ascend_moved(dtype, caches, keys, values, deltas=None, key_temperature=1.0):
    want = ascend_caches(dtype)
    for cache, target, key, value in zip(caches, want, keys, values):
        for part, into in zip(cache, target):
            into.copy_(part)
        key = key[SRC] if deltas is None else rotation().rotate(key[SRC], torch.from_numpy(deltas))
        write_ascend(key if key_temperature == 1 else key / key_temperature, value[SRC], target, torch.from_numpy(DST))
    return want


def same(got, want) -> bool:
    return all(torch.equal(g, w) for pair_got, pair_want in zip(got, want) for g, w in zip(pair_got, pair_want))


def test_ascend_caches_are_separate_k_and_v_tensors():
    """What vllm-ascend hands each layer: two tensors of their own storage, block-outermost and
    contiguous, so no single tensor per layer (and no ``shape.index(num_blocks)``) describes it."""
    caches = ascend_caches(torch.float32)
    assert all(isinstance(c, tuple) and len(c) == 2 for c in caches)
    storages = {t.untyped_storage().data_ptr() for c in caches for t in c}
    assert len(storages) == 2 * LAYERS
    assert all(t.shape == (BLOCKS, BS, HEADS, DIM) and t.is_contiguous() for c in caches for t in c)
    slot_map = KVSlotMap.of_split(*caches[0])
    assert slot_map.split and slot_map.block_stride == BS * HEADS * DIM and None not in slot_map.strides


@pytest.mark.parametrize("key_temperature", [1.0, 0.7], ids=["plain", "temperature"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ascend_slot_copy(dtype, path, key_temperature):
    caches, keys, values = ascend_filled(dtype, seed=1)
    want = ascend_moved(dtype, caches, keys, values, key_temperature=key_temperature)
    ascend_copier(caches, path).copy_slots(SRC, DST, key_temperature)
    assert same(caches, want)
    slots = torch.from_numpy(DST)
    for layer, (k_cache, v_cache) in enumerate(caches):  # by logical indexing
        assert torch.equal(k_cache[slots // BS, slots % BS], keys[layer, SRC] / key_temperature
                           if key_temperature != 1 else keys[layer, SRC])
        assert torch.equal(v_cache[slots // BS, slots % BS], values[layer, SRC])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ascend_rotated_copy_and_key_reads(dtype, path):
    deltas = (np.arange(70) % 7 + 190) * np.where(np.arange(70) % 2, -1, 1)
    caches, keys, values = ascend_filled(dtype, seed=2)
    want = ascend_moved(dtype, caches, keys, values, deltas)
    copier = ascend_copier(caches, path)
    copier.copy_slots_rotated(SRC, DST, deltas, rotation())
    rotated = rotation().rotate(keys[:, SRC], torch.from_numpy(deltas))
    assert same(caches, want)
    slots = torch.from_numpy(DST)
    for layer, (k_cache, v_cache) in enumerate(caches):
        assert torch.equal(k_cache[slots // BS, slots % BS], rotated[layer])
        assert torch.equal(v_cache[slots // BS, slots % BS], values[layer, SRC])
        assert torch.equal(copier.read_keys(layer, DST), rotated[layer])
        assert torch.equal(copier.read_keys(layer, SRC), keys[layer, SRC])


def test_ascend_block_copy_and_tier_blocks():
    caches, _, _ = ascend_filled(torch.float32, seed=3)
    copier = ascend_copier(caches, "strided")
    assert copier.block_shape == [2, BS, HEADS, DIM]
    data = copier.read_blocks([2, 5])
    assert list(data.shape) == [LAYERS, 2, 2, BS, HEADS, DIM]
    assert torch.equal(data[1, 0, 0], caches[1][0][2]) and torch.equal(data[1, 1, 1], caches[1][1][5])
    want = [tuple(t.clone() for t in c) for c in caches]
    for pair in want:
        for t in pair:
            t[[0, 3]] = t[[2, 5]]
    copier.write_blocks([0, 3], data)
    assert same(caches, want)
    for pair in want:
        for t in pair:
            t[4] = t[1]
    copier.copy_blocks([1], [4])
    assert same(caches, want)


def test_ascend_map_refuses_mla_pairs_and_a_wrong_map():
    """MLA's pair (nope cache [.., kv_lora_rank], rope cache [.., qk_rope_head_dim]) has no common
    K/V geometry: refused. A map from another layout fails ``verify`` on the pair."""
    nope, rope = torch.zeros(BLOCKS, BS, 1, 512), torch.zeros(BLOCKS, BS, 1, 64)
    with pytest.raises(ValueError, match="different shapes or strides"):
        KVSlotMap.of_split(nope, rope)
    caches = ascend_caches(torch.float32)
    head_major = torch.zeros(BLOCKS, HEADS, BS, DIM).transpose(1, 2)  # the same shape, heads outside offsets
    wrong = KVSlotMap.of_split(head_major, head_major)
    with pytest.raises(RuntimeError, match="does not address the real KV cache"):
        wrong.verify(write_ascend, caches[0], BLOCKS * BS - 1)
