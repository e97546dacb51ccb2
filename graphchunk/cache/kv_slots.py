"""Token-granular access to a paged KV cache whose layout belongs to vLLM and the backend.

vLLM 0.32 views each layer's cache as logical ``[blocks, heads, block_size, 2 * head_size]``
whose physical order is a ``KVCacheLayout`` (LBHNC on the CPU backend, LBNHC by default on CUDA,
block-outermost ones where layers share each block): the per-layer tensor is a strided view, not
contiguous in general. Backends then pack a block their own way on top (vLLM's CPU backend reads
a block as ``[heads, 2 * block_size, head_size]`` and may store K transposed). So graphchunk
assumes neither: it writes probe values through the backend's own KV-write op into a two-block
scratch with the real cache's very strides (``KVSlotMap.probe``), reads back where each (slot
offset, K/V, head, dim) landed in storage, and checks the map once on the real cache's own
unused pool slot (``KVSlotMap.verify``). Offsets are relative to a layer's first element, so they
hold for every layer of any layout. When each of K and V is an affine (strided) map of (block,
offset, head, dim), as on every GPU backend and on the CPU backend in fp32, copies run over all
layers at once: on an accelerator as one gather and one scatter of every slot per view (K, V; a
fixed number of launches per step, however many requests and chunks it fills: ``gather``), on a
CPU as strided slice copies, one per run of slots consecutive on both sides (no launch to pay
there, and a slice moves ~5x faster than an indexed gather on these CPUs).
Otherwise (the CPU backend in bf16 on CPUs with AMX tiles K for its kernel) the sources' K/V are
gathered element by element, layer by layer, and written through the backend's own KV-write op
(``writers``). Isolated mode's key temperature divides K as it is copied (V as is). Blend mode's
copies (``copy_slots_rotated``) rotate K on the way (``rope.KeyRotation``): on an affine layout K
is gathered for all layers and tokens at once, rotated and scattered; V is copied as is.
``read_slots`` and ``write_slots`` split a copy in two (every layer's K/V of some slots out as one
tensor, and in at other slots, K through a function such as a rotation): a host-memory entry's payload.

A seventh layout is vllm-ascend's: each layer's cache is a pair ``(k_cache, v_cache)`` of separate
tensors ``[blocks, block_size, heads, head_size]`` (``NPUModelRunner._reshape_kv_cache_tensors``)
that its write op indexes logically. Its map is read from the tensors' strides, nothing probed
(``KVSlotMap.of_split``: vllm-ascend's attention keeps the first caches its write op is handed, so a
scratch probed through it would become the layer's cache); K offsets then count from the K tensor's
first element, V offsets from the V tensor's, and every operation above works on the pair.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from graphchunk.device import consecutive_runs


class KVSlotMap:
    """Where every element of a slot lives, relative to a layer's first element."""

    def __init__(self, coords: torch.Tensor, block_stride: int, split: bool = False):
        self.coords = coords  # [block_size, 2 (K/V), heads, head_size] offsets in block 0
        self.block_stride = block_stride
        self.split = split  # K and V in separate tensors: K offsets in K's storage, V offsets in V's
        self.block_size = coords.shape[0]
        self.strides = [_affine_strides(coords[:, kind]) for kind in (0, 1)]

    @classmethod
    def probe(cls, write_kv, like: torch.Tensor, block_dim: int, block_size: int, num_heads: int,
              head_size: int) -> "KVSlotMap":
        """``write_kv(key, value, cache, slot_mapping)`` is the backend's write op; ``like`` a
        layer's real cache, whose shape and strides the two-block scratch probed takes."""
        cache = scratch_like(like, block_dim, 2)
        shape = (2 * block_size, 2, num_heads, head_size)  # (slot, K/V, head, dim) of two blocks
        codes = torch.arange(1, math.prod(shape) + 1).view(shape)  # each element's id + 1; 0: not written
        found = torch.zeros(_storage_view(cache).numel(), dtype=torch.long)
        slots = torch.arange(shape[0], device=like.device)
        for shift in range(0, int(codes.max()).bit_length(), 8):  # a byte of each code per write:
            digits = ((codes >> shift) & 255).to(like.dtype).to(like.device)  # exact in bf16 and wider
            cache.zero_()
            write_kv(digits[:, 0].contiguous(), digits[:, 1].contiguous(), cache, slots)
            found += _storage_view(cache).float().cpu().long() << shift
        where = torch.nonzero(found).flatten()
        coords = torch.full((math.prod(shape),), -1, dtype=torch.long)
        if len(where) == coords.numel() and int(found.max()) <= coords.numel():
            coords[found[where] - 1] = where
        if (coords < 0).any():
            raise RuntimeError("KV layout probe: the backend's write op did not place every element exactly once")
        coords = coords.view(2, block_size, *shape[1:])
        stride = coords[1] - coords[0]
        if not (stride == stride.flatten()[0]).all():
            raise RuntimeError("KV layout probe: blocks are not evenly strided in storage")
        return cls(coords[0], int(stride.flatten()[0]))

    @classmethod
    def of_split(cls, key_cache: torch.Tensor, value_cache: torch.Tensor) -> "KVSlotMap":
        """The map of a layer whose K and V are separate tensors ``[blocks, block_size, heads,
        head_size]`` of one shape and strides, written by logical index (vllm-ascend's
        ``reshape_and_cache``: ``key_cache[slot // block_size, slot % block_size] = key``): read
        from their strides, nothing written. Other pairs (MLA's nope and rope caches) are refused."""
        if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
            raise ValueError(f"K and V caches of different shapes or strides (K {list(key_cache.shape)} strides "
                             f"{list(key_cache.stride())}, V {list(value_cache.shape)} strides "
                             f"{list(value_cache.stride())}): graphchunk copies K and V of equal heads and head size")
        grids = torch.meshgrid(*(torch.arange(n) for n in key_cache.shape[1:]), indexing="ij")
        one = sum(grid * stride for grid, stride in zip(grids, key_cache.stride()[1:]))
        return cls(torch.stack([one, one], dim=1), key_cache.stride(0), split=True)

    def verify(self, write_kv, cache, slot: int) -> None:
        """Checks the map on a real cache (a tensor, or a ``(k_cache, v_cache)`` pair): random K/V
        written through the backend's op at ``slot`` (an unused one: a pool slot at start-up) are
        where the map says; the slot is restored."""
        flat_k, flat_v = _flats(cache)
        device, dtype, shape = flat_k.device, flat_k.dtype, self.coords.shape[2:]
        k_at, v_at = self.key_offsets([slot]).flatten().to(device), self.value_offsets([slot]).to(device)
        saved = flat_k[k_at].clone(), flat_v[v_at].clone()
        generator = torch.Generator().manual_seed(slot)
        key, value = (torch.randn(1, *shape, generator=generator).to(dtype).to(device) for _ in range(2))
        try:
            write_kv(key, value, cache, torch.tensor([slot], device=device))
            if not (torch.equal(flat_k[k_at].view(shape), key[0]) and torch.equal(flat_v[v_at].view(shape), value[0])):
                raise RuntimeError(f"KV layout probe: the probed slot map does not address the real KV cache "
                                   f"({_describe(cache)})")
        finally:
            flat_k[k_at], flat_v[v_at] = saved

    def offsets(self, slots: np.ndarray) -> torch.Tensor:
        """Flat storage offsets [n * elements] of the given slots."""
        slots = torch.from_numpy(np.asarray(slots, np.int64))
        blocks, within = slots // self.block_size, slots % self.block_size
        return (self.coords.reshape(self.block_size, -1)[within] + blocks[:, None] * self.block_stride).flatten()

    def value_offsets(self, slots: np.ndarray) -> torch.Tensor:
        """Flat storage offsets [n * heads * head_size] of the values of the given slots."""
        return self.offsets(slots).view(len(slots), 2, self.coords[0, 0].numel())[:, 1].flatten()

    def key_offsets(self, slots: np.ndarray) -> torch.Tensor:
        """Flat storage offsets [n, heads, head_size] of the keys of the given slots."""
        slots = torch.from_numpy(np.asarray(slots, np.int64))
        blocks, within = slots // self.block_size, slots % self.block_size
        return self.coords[within, 0] + blocks[:, None, None] * self.block_stride


def _affine_strides(coords: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(first, offset stride, head stride, dim stride) if ``coords[o, h, d]`` is affine, else None."""
    first = int(coords[0, 0, 0])
    steps = [int(coords[1, 0, 0]) - first if coords.shape[0] > 1 else 0,
             int(coords[0, 1, 0]) - first if coords.shape[1] > 1 else 0,
             int(coords[0, 0, 1]) - first if coords.shape[2] > 1 else 0]
    grids = torch.meshgrid(*(torch.arange(n) for n in coords.shape), indexing="ij")
    predicted = first + sum(g * s for g, s in zip(grids, steps))
    return (first, *steps) if torch.equal(predicted, coords) else None


def scratch_like(like: torch.Tensor, block_dim: int, num_blocks: int) -> torch.Tensor:
    """Zeros shaped like ``like`` with ``num_blocks`` blocks and ``like``'s very strides (so the
    storage offsets measured in it are the real cache's, gaps of a strided layout included)."""
    shape = list(like.shape)
    shape[block_dim] = num_blocks
    span = _span(shape, like.stride())
    return torch.zeros(span, dtype=like.dtype, device=like.device).as_strided(shape, like.stride())


def _span(shape, strides) -> int:
    """Elements from a strided tensor's first element to its last, inclusive."""
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))


def _storage_view(cache: torch.Tensor) -> torch.Tensor:
    """1-D view from the tensor's first element over the storage it spans."""
    return cache.as_strided((_span(cache.shape, cache.stride()),), (1,))


def _part(cache, kind: int) -> torch.Tensor:
    """The tensor holding ``kind`` (0: K, 1: V) of a layer's cache: the cache itself, or that
    element of a ``(k_cache, v_cache)`` pair."""
    return cache if isinstance(cache, torch.Tensor) else cache[kind]


def _flats(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1-D storage views (K's, V's) that a slot map's K and V offsets index."""
    return _storage_view(_part(cache, 0)), _storage_view(_part(cache, 1))


def _describe(cache) -> str:
    return "; ".join(f"shape {list(t.shape)}, strides {list(t.stride())}"
                     for t in ([cache] if isinstance(cache, torch.Tensor) else cache))


class KVCopier:
    """Copies slot KV between places in every layer's cache (positions unchanged: no rotation)."""

    def __init__(self, caches: list, slot_map: KVSlotMap, num_blocks: int, block_dim: int = 0,
                 writers=None, gather: bool | None = None):
        """``caches``: per layer, its cache tensor, or its ``(k_cache, v_cache)`` pair (``block_dim``
        0). ``writers``: per layer, the backend's KV-write op ``write(key, value, cache, slots)`` (K/V
        [n, heads, head_size], ``slots`` a device tensor), through which copies on a layout that is
        not affine write (without them, element by element into storage). ``gather``: copies on an
        affine layout index every slot at once instead of slicing runs (default: off a CPU)."""
        self.device = _part(caches[0], 0).device
        self.gather = self.device.type != "cpu" if gather is None else gather
        self.caches = caches
        self.slot_map = slot_map
        self.block_dim = block_dim
        self.writers = writers
        self.layer_stride = _uniform_layer_stride(caches)
        self.views = self._strided_views(num_blocks) if None not in slot_map.strides else None

    def _strided_views(self, num_blocks: int) -> list[torch.Tensor]:
        """Per kind (K, V) and layer, a view [blocks, offset, head, dim]; when the layers sit in
        one storage at equal spacing, one view per kind with a leading layer dimension."""
        m = self.slot_map
        one_for_all = self.layer_stride is not None
        views = []
        for kind, (first, s_off, s_head, s_dim) in enumerate(m.strides):
            for cache in self.caches[:1] if one_for_all else self.caches:
                shape = [num_blocks, m.block_size, *m.coords.shape[2:]]
                strides = [m.block_stride, s_off, s_head, s_dim]
                if one_for_all:
                    shape, strides = [len(self.caches), *shape], [self.layer_stride, *strides]
                part = _part(cache, kind)
                views.append(part.as_strided(shape, strides, part.storage_offset() + first))
        return views

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, key_temperature: float = 1.0) -> None:
        """Copies every layer's K and V of slots ``src`` to ``dst``; keys divided by ``key_temperature``
        (isolated mode's temperature) unless it is 1, when the elements move unchanged."""
        if self.views is None:
            self._move(src, dst, None if key_temperature == 1 else lambda keys: keys / key_temperature)
            return
        if key_temperature == 1:
            self._copy(src, dst, self.views)
            return
        half = len(self.views) // 2
        self._copy(src, dst, self.views[half:])
        self._copy(src, dst, self.views[:half], key_temperature)

    def _copy(self, src: np.ndarray, dst: np.ndarray, views: list[torch.Tensor], divisor: float = 1.0) -> None:
        """Slots ``src`` to ``dst`` in each of ``views`` ([layers,] blocks, offset, head, dim), values
        divided by ``divisor`` unless it is 1."""
        if not self.gather:
            self._copy_runs(src, dst, views, divisor)
            return
        sb, so, db, do = self._indices(src, dst)
        for view in views:
            moved = view[..., sb, so, :, :]
            view[..., db, do, :, :] = moved if divisor == 1 else moved / divisor

    def _indices(self, *slot_lists: np.ndarray) -> tuple[torch.Tensor, ...]:
        """(block, offset) of each slot of each of ``slot_lists`` (e.g. src, dst), on the caches' device."""
        bs, device = self.slot_map.block_size, self.device
        return tuple(torch.from_numpy(x).to(device, non_blocking=True)
                     for slots in slot_lists for x in _block_offset(slots, bs))

    def _flat_offsets(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage offsets [n, heads, head_size] of the K and of the V of ``slots``, on the caches' device."""
        m, shape = self.slot_map, self.slot_map.coords.shape[2:]
        return m.key_offsets(slots).to(self.device), m.value_offsets(slots).view(len(slots), *shape).to(self.device)

    def _copy_runs(self, src: np.ndarray, dst: np.ndarray, views: list[torch.Tensor], divisor: float = 1.0) -> None:
        bs = self.slot_map.block_size
        for s, d, n in consecutive_runs(src, dst, block_size=bs):
            for view in views:
                moved = view[..., s // bs, s % bs:s % bs + n, :, :]
                view[..., d // bs, d % bs:d % bs + n, :, :] = moved if divisor == 1 else moved / divisor

    def copy_slots_rotated(self, src: np.ndarray, dst: np.ndarray, deltas: np.ndarray, rotation) -> None:
        """Like ``copy_slots``, each key rotated by ``deltas`` positions (``rotation``: a
        ``rope.KeyRotation``); one gather, rotation and scatter over all layers when they share a
        storage at equal spacing."""
        deltas = torch.from_numpy(np.asarray(deltas, np.int64))
        if self.views is None:
            self._move(src, dst, lambda keys: rotation.rotate(keys, deltas))
            return
        half = len(self.views) // 2
        self._copy(src, dst, self.views[half:])
        sb, so, db, do = self._indices(src, dst)
        for view in self.views[:half]:
            view[..., db, do, :, :] = rotation.rotate(view[..., sb, so, :, :], deltas)

    def _move(self, src: np.ndarray, dst: np.ndarray, key=None) -> None:
        """Every layer's K and V of slots ``src`` to ``dst`` on a layout that is not affine: gathered
        element by element, K through ``key`` (a function of [n, heads, head_size]) when given, and
        written through the backend's write op (without one, element by element)."""
        (k_src, v_src), (k_dst, v_dst) = self._flat_offsets(src), self._flat_offsets(dst)
        where = torch.from_numpy(np.asarray(dst, np.int64)).to(self.device)
        for layer, cache in enumerate(self.caches):
            flat_k, flat_v = _flats(cache)
            keys, values = flat_k[k_src], flat_v[v_src]
            keys = keys if key is None else key(keys)
            if self.writers is None:
                flat_k[k_dst], flat_v[v_dst] = keys, values
            else:
                self.writers[layer](keys, values, cache, where)

    def read_slots(self, slots: np.ndarray) -> torch.Tensor:
        """Every layer's K and V of ``slots``, as a tensor [layers, 2 (K/V), n, heads, head_size] on the
        caches' device (a copy, contiguous): a host-memory entry's payload (``HostTier``), read once from
        the pool's blocks."""
        n, shape = len(slots), self.slot_map.coords.shape[2:]
        if self.views is None:
            offsets = self._flat_offsets(slots)
            parts = [flat[at] for cache in self.caches for flat, at in zip(_flats(cache), offsets)]
        else:  # per layer (or once for all), K's view then V's: the stack below is layer-major
            blocks, offsets = self._indices(slots)
            half = len(self.views) // 2
            parts = [view[..., blocks, offsets, :, :] for layer in range(half) for view in self.views[layer::half]]
        return torch.stack(parts, -4).view(len(self.caches), 2, n, *shape)

    def write_slots(self, data: torch.Tensor, dst: np.ndarray, key=None) -> None:
        """Writes ``data`` ([layers, 2, n, heads, head_size], as ``read_slots`` gives it, on any device:
        moved to the caches' device) into slots ``dst`` of every layer, K through ``key`` (a function of a
        K tensor [..., n, heads, head_size] returning the same shape, e.g. a key temperature's division or
        ``rope.KeyRotation.rotate(k, deltas)``) when given; V as is. On a layout that is not affine, through
        the backend's write op when there is one (as ``_move`` does), else element by element."""
        if not len(dst):
            return
        data = data.to(self.device)
        keys, values = data[:, 0] if key is None else key(data[:, 0]), data[:, 1]
        if self.views is None:
            k_at, v_at = self._flat_offsets(dst)
            where = torch.from_numpy(np.asarray(dst, np.int64)).to(self.device)
            for layer, cache in enumerate(self.caches):
                if self.writers is None:
                    flat_k, flat_v = _flats(cache)
                    flat_k[k_at], flat_v[v_at] = keys[layer], values[layer]
                else:
                    self.writers[layer](keys[layer], values[layer], cache, where)
            return
        blocks, offsets = self._indices(dst)
        half = len(self.views) // 2
        for kind, part in enumerate((keys, values)):
            for layer, view in enumerate(self.views[kind * half:(kind + 1) * half]):
                view[..., blocks, offsets, :, :] = part if self.layer_stride is not None else part[layer]

    def read_keys(self, layer: int, slots: np.ndarray) -> torch.Tensor:
        """K of ``slots`` at ``layer``: [n, heads, head_size] (a copy)."""
        return self.read_layer_keys(slots, [layer])[0]

    def read_layer_keys(self, slots: np.ndarray, layers) -> list[torch.Tensor]:
        """K of ``slots`` at each of ``layers`` (indices): [n, heads, head_size] each (copies); where
        the slots are is worked out once for all of them."""
        if self.views is None:
            where = self.slot_map.key_offsets(slots).to(self.device)
            return [_flats(self.caches[layer])[0][where] for layer in layers]
        blocks, offsets = (torch.from_numpy(x) for x in _block_offset(slots, self.slot_map.block_size))
        return [(self.views[0][layer] if self.layer_stride is not None else self.views[layer])[blocks, offsets]
                for layer in layers]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks of every layer, as a host tensor [layers, blocks, *one block] (a pair's
        block: [2 (K/V), *one block of K])."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([self._read_block_ids(cache, ids) for cache in self.caches]).cpu()

    def _read_block_ids(self, cache, ids: torch.Tensor) -> torch.Tensor:
        parts = [part.index_select(0, ids) for part in self._block_major(cache)]
        return parts[0] if isinstance(cache, torch.Tensor) else torch.stack(parts, 1)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for cache, layer in zip(self.caches, data.to(self.device), strict=True):
            parts = self._block_major(cache)
            for kind, part in enumerate(parts):
                part.index_copy_(0, ids, layer if len(parts) == 1 else layer[:, kind])

    def _block_major(self, cache) -> list[torch.Tensor]:
        """The layer's cache tensors (one, or K and V) with the block dimension first."""
        return [cache.movedim(self.block_dim, 0)] if isinstance(cache, torch.Tensor) else list(cache)

    @property
    def block_shape(self) -> list[int]:
        cache = self.caches[0]
        if not isinstance(cache, torch.Tensor):
            return [len(cache), *cache[0].shape[1:]]
        shape = list(cache.shape)
        del shape[self.block_dim]
        return shape

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        bs = self.slot_map.block_size
        slots = lambda blocks: (np.asarray(blocks, np.int64)[:, None] * bs + np.arange(bs)).flatten()  # noqa: E731
        self.copy_slots(slots(src), slots(dst))


def _block_offset(slots: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    slots = np.asarray(slots, np.int64)
    return slots // block_size, slots % block_size


def _uniform_layer_stride(caches: list[torch.Tensor]) -> int | None:
    """Element stride between consecutive layers when all live in one storage at equal spacing."""
    if len(caches) < 2 or not isinstance(caches[0], torch.Tensor):
        return None
    storage = caches[0].untyped_storage().data_ptr()
    if any(c.untyped_storage().data_ptr() != storage for c in caches):
        return None
    steps = {b.storage_offset() - a.storage_offset() for a, b in zip(caches, caches[1:])}
    return steps.pop() if len(steps) == 1 else None
