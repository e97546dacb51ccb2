"""``graphchunk.Worker``: the platform's vLLM worker with the chunk-aware model runner.

    vllm serve MODEL --worker-cls graphchunk.Runner --additional-config '{"graphchunk": {...}}'

``graphchunk.Runner`` is the name deployments pass to ``--worker-cls`` (kept: it has always been
documented so); it is this worker class, ``graphchunk.Worker``, under a second name.

The worker class is chosen from the running platform: CPUWorker on CPU, the CUDA Worker on
NVIDIA. Ascend is refused at start-up, naming what is missing (``ascend_refusal``; read against
vllm-ascend's own source, ``graphchunk/contract/ascend.py``). On CUDA the chunk-aware model runner
is built through the CUDA Worker's own hook, ``_make_model_runner``; CPUWorker and NPUWorker build
their runner inside ``init_device`` with no hook, and its class is swapped right after.
"""
from __future__ import annotations

import dataclasses

from graphchunk.blend.rope import blend_refusal
from graphchunk.cache.store import prepare_directory, weights_digest
from graphchunk.compat import UnsupportedVLLM, release, vllm_name
from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.engine.frontend import temperature_refusal
from graphchunk.engine.graph_config import vllm_graphs
from graphchunk.engine.kv_binding import tp_min
from graphchunk.engine.model_runner import chunk_runner_class
from graphchunk.graphs.buckets import BucketGrid, load_grid
from graphchunk.log import logger


def platform_worker_class() -> type:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker
        return CPUWorker
    if current_platform.is_cuda_alike():
        from vllm.v1.worker.gpu_worker import Worker
        return Worker
    if current_platform.device_name == "npu":
        raise ConfigError(ascend_refusal())
    raise RuntimeError(f"graphchunk has no worker for platform {current_platform.device_name!r}")


def ascend_refusal() -> str:
    """Why graphchunk does not start on Ascend (docs/gpu.md, 'Ascend'): what it would need from
    vllm-ascend and does not have."""
    from graphchunk.compat import RELEASES

    return ("graphchunk does not run on Ascend yet: its chunk forwards (documents prefilled outside vLLM's step, "
            "graphchunk/engine/runner_kv.py) build vLLM's CommonAttentionMetadata under vLLM's set_forward_context, "
            "while vllm-ascend's attention needs, for every forward, AscendCommonAttentionMetadata (its attn_state "
            "and actual_seq_lengths_q; vllm_ascend.attention.utils), the forward context of "
            "set_ascend_forward_context (vllm_ascend.ascend_forward_context) and the rotary tables of "
            "update_cos_sin(positions) (vllm_ascend.ops.rotary_embedding); graphchunk builds none of them (no NPU "
            f"to verify them on). And no vllm-ascend release pairs with a vLLM graphchunk admits "
            f"({', '.join(RELEASES)}): the newest, vllm-ascend 0.30.0, is for vLLM 0.30. See docs/gpu.md, 'Ascend'")


def check_config(vllm_config, config: GraphChunkConfig) -> None:
    """Start-up checks that would otherwise fail later, inside a step."""
    try:
        release()
    except UnsupportedVLLM as exc:  # a vLLM graphchunk does not admit, refused naming the ones it does
        raise ConfigError(str(exc)) from None
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise ConfigError(v2_refusal())
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("graphchunk does not support pipeline parallelism")
    if parallel.data_parallel_size != 1:
        check_data_parallel(vllm_config, config)
    if vllm_config.speculative_config is not None:
        raise ConfigError("graphchunk does not support speculative decoding")
    if vllm_config.lora_config is not None:
        raise ConfigError("graphchunk does not support LoRA (enable_lora): its chunk forwards run outside vLLM's "
                          "per-step adapter mapping, and cached chunk KV is keyed without the adapter; start "
                          "without --enable-lora")
    check_kv_cache_dtype(vllm_config.cache_config)
    check_connector(vllm_config.kv_transfer_config)
    if vllm_config.model_config.uses_mrope:
        raise ConfigError("graphchunk does not support models with M-RoPE (multimodal rotary positions, e.g. "
                          "Qwen2-VL, Qwen2.5-VL, Qwen3-VL; vLLM's model_config.uses_mrope): vLLM feeds them "
                          "multi-dimensional positions (mrope_positions), while graphchunk's isolated-mode positions "
                          "and its chunk forwards are one-dimensional")
    check_sliding_window(vllm_config.model_config.hf_config)
    refusal = blend_refusal(vllm_config.model_config)
    if config.mode == "blend" and refusal:
        raise ConfigError(f"graphchunk.mode='blend' is not available for this model: {refusal}; "
                          f"use mode 'isolated' (or 'auto')")
    if config.mode == "auto":
        logger.info("graphchunk: segmented requests default to %s mode (graphchunk.mode='auto')%s",
                    config.default_mode(refusal), f": blend is not available for this model: {refusal}" if refusal else "")
    if config.key_temperature != 1:
        refusal = temperature_refusal(vllm_config.model_config.hf_config)
        if refusal:
            raise ConfigError(f"graphchunk.key_temperature={config.key_temperature} is not available for this "
                              f"model: {refusal}")
    if config.templates:
        check_grid(vllm_config, load_grid(config.templates))
    if config.store_path:
        prepare_directory(config.store_path)
        weights_digest(vllm_config.model_config.model, vllm_config.model_config.revision)
    needed = min_pool_blocks(vllm_config, config)
    block_size = vllm_config.cache_config.block_size
    if config.pool_tokens and config.pool_blocks(block_size) < needed:
        raise ConfigError(f"graphchunk.pool_tokens={config.pool_tokens} is too small: the pool must hold a sys "
                          f"prompt of max_model_len tokens plus one chunk of max_chunk_len tokens, "
                          f"{needed * block_size} tokens at block size {block_size}")
    check_pool_fits(vllm_config, config)


def check_sliding_window(hf_config) -> None:
    """Sliding-window layers (Gemma-2, Gemma-3, Mistral v0.1, Phi-3-mini's 2047): vLLM keeps their KV
    in a KV-cache group of its own and drops keys outside the window by sequence index, while
    graphchunk's chunk and context forwards attend over one full-attention group. vLLM's
    ``--disable-sliding-window`` (it clears ``sliding_window`` and caps max_model_len at the window,
    where no key ever leaves it) makes such a model plain full attention, exactly."""
    window = getattr(getattr(hf_config, "get_text_config", lambda: hf_config)(), "sliding_window", None)
    if window:
        raise ConfigError(f"graphchunk does not support sliding-window attention (the model's sliding_window="
                          f"{window}): its chunk and context forwards attend over one full-attention KV cache; "
                          f"start with --disable-sliding-window (vLLM then caps max_model_len at {window} tokens, "
                          f"within which the window drops nothing)")


def v2_refusal() -> str:
    """The refusal of a configuration that selects vLLM's V2 model runner: what selects it, and what
    staying on V1 costs (the features V1 refuses, read from the running vLLM: ``plugin.v1_refused_features``)."""
    from graphchunk.engine.plugin import v1_refused_features

    refused = v1_refused_features()
    return ("graphchunk needs vLLM's V1 model runner (its chunk-aware runner extends V1's; it has no V2 "
            "counterpart yet: docs/architecture.md, \"Model Runner V2\"), and this configuration selects V2: "
            "VLLM_USE_V2_MODEL_RUNNER=1, or a setting with which vLLM selects V2 whatever else is set (HiSparse "
            "attention, watermarking); graphchunk engines select V1 by themselves: unset VLLM_USE_V2_MODEL_RUNNER"
            + (f" (a graphchunk engine cannot use what V1 refuses: {', '.join(refused)})" if refused else ""))


def check_data_parallel(vllm_config, config: GraphChunkConfig) -> None:
    """Data parallelism, seen where the engine's config is built (each engine core of a dense
    model then sees data_parallel_size 1). vLLM runs a dense model's data-parallel ranks as
    independent engines (no collective between them: each engine core its own scheduler,
    connector and worker), so each has a chunk pool of its own. A mixture-of-experts model's ranks
    are coordinated forward by forward (an all-reduce of every forward's token count in
    set_forward_context, dummy batches on idle ranks): graphchunk's chunk forwards run on one rank
    only, the others would never join, so it is refused."""
    size = vllm_config.parallel_config.data_parallel_size
    if vllm_config.model_config.is_moe:
        raise ConfigError(f"graphchunk does not support data parallelism (data_parallel_size={size}) for a "
                          f"mixture-of-experts model: vLLM coordinates every forward of its data-parallel ranks "
                          f"and graphchunk's chunk forwards run on one rank only; run one server per replica "
                          f"(behind a router), or use tensor parallelism")
    logger.info("graphchunk: data parallelism (data_parallel_size=%d, a dense model: vLLM runs each rank as an "
                "independent engine): each engine core has its own chunk pool and KV connector%s", size,
                "; they share computed documents through the persistent tier (graphchunk.store_path)"
                if config.store_path else "; set graphchunk.store_path to share computed documents between them")


def check_connector(kv_transfer_config) -> None:
    """The engine loads its segmented requests' context through graphchunk's KV connector."""
    from graphchunk.engine.connector import KV_CONNECTOR, connector_config

    if kv_transfer_config is None:
        raise ConfigError(f"this graphchunk engine's configuration has no KV connector (kv_transfer_config is "
                          f"unset): build it through vLLM's EngineArgs, where graphchunk sets its own, or name "
                          f"{KV_CONNECTOR} in --kv-transfer-config")
    connector_config(kv_transfer_config)


def check_kv_cache_dtype(cache_config) -> None:
    """The KV cache must hold plain floats (the model's dtype, or a float ``--kv-cache-dtype``):
    graphchunk's slot copies, key rotation and key reads move and rotate elements, with no fp8
    scales and no packed formats. Run on the built config (vLLM resolves a checkpoint's KV
    quantization scheme into ``cache_dtype`` there) and again after the worker loaded the model."""
    if vllm_name("is_quantized_kv_cache")(cache_config.cache_dtype):
        raise ConfigError(f"graphchunk does not support a quantized KV cache, kv_cache_dtype="
                          f"{cache_config.cache_dtype!r} (--kv-cache-dtype, or the checkpoint's KV cache quantization): "
                          f"its slot copies and key rotation are written for float KV caches; start with "
                          f"--kv-cache-dtype auto")


POOL_SHARE = 0.5
"""The chunk pool's share of the KV-cache budget vLLM resolved, when ``pool_tokens`` is 0 (unset)."""
POOL_SHARE_OVER_HOST = 0.25
"""The same with host memory below the pool (``host_bytes``): the pool is the hot set, host memory
gives back what it drops without a forward, and running requests keep the rest. Measured at a
budget that binds (perf/results/sizing.json, docs/sizing.md): a pool of 0.25 over host memory ran
13 requests at once and 2.62 requests/s, the pool of 0.5 9 and 2.41."""


def pool_share(config: GraphChunkConfig) -> float:
    """The pool's share of the KV-cache budget when ``pool_tokens`` is unset."""
    return POOL_SHARE_OVER_HOST if config.host_bytes else POOL_SHARE


def min_pool_blocks(vllm_config, config: GraphChunkConfig) -> int:
    """What the pool must hold at once: one unit of chunk work, a sys prompt (up to max_model_len)
    and one chunk of max_chunk_len (units are planned one at a time)."""
    from vllm.utils.math_utils import cdiv

    block_size = vllm_config.cache_config.block_size
    return cdiv(vllm_config.model_config.max_model_len, block_size) + 1 + cdiv(config.max_chunk_len, block_size)


def pool_blocks_in(budget: int, block_bytes: int, min_blocks: int, config: GraphChunkConfig, block_size: int,
                   budget_name: str) -> int:
    """The pool's blocks out of a KV-cache budget of ``budget`` bytes: ``pool_tokens`` when set, else
    ``pool_share`` of the budget and at least ``min_blocks``; refused when they leave vLLM nothing."""
    if config.pool_tokens:
        blocks = config.pool_blocks(block_size)
        what = f"graphchunk.pool_tokens={config.pool_tokens}"
        advice = "raise it, or lower pool_tokens"
    else:
        blocks = max(min_blocks, int(budget * pool_share(config)) // block_bytes)
        what = (f"graphchunk's chunk pool (pool_tokens unset) must hold a sys prompt of max_model_len tokens and one "
                f"chunk of max_chunk_len, {min_blocks * block_size} tokens, and")
        advice = "raise it, or lower --max-model-len or graphchunk.max_chunk_len"
    if blocks * block_bytes >= budget:
        raise ConfigError(f"{what} needs {blocks * block_bytes} bytes of KV cache but {budget_name} is {budget}: "
                          f"{advice}")
    return blocks


def check_pool_fits(vllm_config, config: GraphChunkConfig) -> None:
    """With ``--kv-cache-memory-bytes`` the pool's share of the KV cache is known before a worker
    starts (the worker sizes it against what it measured, ``determine_available_memory``)."""
    cache, model = vllm_config.cache_config, vllm_config.model_config
    kv_bytes = getattr(cache, "kv_cache_memory_bytes", None)
    if not kv_bytes:
        return
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    dtype = model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    parallel = vllm_config.parallel_config
    per_token = (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
                 * dtype.itemsize)
    pool_blocks_in(kv_bytes, cache.block_size * per_token, min_pool_blocks(vllm_config, config), config,
                   cache.block_size, "--kv-cache-memory-bytes")


def check_grid(vllm_config, grid: BucketGrid) -> None:
    """Every bucket must fit one step: vLLM's graphs run it at ``batch * question_tokens`` tokens."""
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    too_big = [b.name for b in grid.buckets if b.num_tokens > max_tokens]
    if too_big:
        raise ConfigError(f"graphchunk.templates: buckets {too_big} pad to more tokens than "
                          f"max_num_batched_tokens={max_tokens}")


def builds_runner_by_hook(base: type) -> bool:
    """Whether ``base`` builds its model runner through vLLM's ``Worker._make_model_runner`` hook:
    vLLM's CUDA Worker does (``init_device`` -> ``_init_workspace_and_model_runner``). CPUWorker
    inherits the hook but never calls it (its ``init_device`` builds ``CPUModelRunner`` inline),
    and vllm-ascend's NPUWorker, a ``WorkerBase``, has none (``NPUModelRunner`` built inline)."""
    from vllm.v1.worker.gpu_worker import Worker

    return base is Worker


def make_worker_class() -> type:
    base = platform_worker_class()

    class Worker(base):
        """The platform's worker whose model runner is chunk-aware; ``graphchunk_*`` methods are
        its RPCs (``GraphChunkLLM`` calls them through ``collective_rpc``)."""

        def __init__(self, vllm_config, *args, **kwargs):
            self.graphchunk_config = GraphChunkConfig.from_additional_config(vllm_config.additional_config)
            check_config(vllm_config, self.graphchunk_config)
            super().__init__(vllm_config, *args, **kwargs)

        if builds_runner_by_hook(base):
            def _make_model_runner(self):
                from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # V1: check_config refuses V2

                runner = chunk_runner_class(GPUModelRunner)(self.vllm_config, self.device)
                runner.graphchunk_setup(self.graphchunk_config)
                return runner
        else:
            def init_device(self):
                super().init_device()
                # Fallback for workers without the hook (CPUWorker, NPUWorker): they build their
                # runner inside init_device, so its class is swapped for the chunk-aware subclass
                # afterwards (the subclass adds methods only, no state of its own before setup).
                runner = self.model_runner
                runner.__class__ = chunk_runner_class(type(runner))
                runner.graphchunk_setup(self.graphchunk_config)

        def load_model(self, *args, **kwargs):
            super().load_model(*args, **kwargs)
            # A model's attention layers may still turn an 'auto' KV cache dtype into fp8 while
            # loading (a checkpoint's kv_cache_scheme): checked again before any KV is allocated.
            check_kv_cache_dtype(self.vllm_config.cache_config)

        def determine_available_memory(self) -> int:
            """vLLM's KV-cache budget less the pool's blocks (the pool sized here when unset)."""
            available = super().determine_available_memory()
            page_bytes = sum(spec.page_size_bytes for spec in self.model_runner.get_kv_cache_spec().values())
            config, block_size = self.graphchunk_config, self.cache_config.block_size
            # Ranks may measure different budgets; each plans the same steps over its heads' share
            # of one pool, so every rank takes the smallest.
            blocks = tp_min(pool_blocks_in(available, page_bytes, min_pool_blocks(self.vllm_config, config),
                                                        config, block_size, "the KV-cache budget"))
            if not config.pool_tokens:
                logger.info("graphchunk: chunk pool sized to %d tokens (%d blocks, %.2f GiB): %.0f%% of the "
                            "KV-cache budget of %.2f GiB (graphchunk.pool_tokens sets it)", blocks * block_size,
                            blocks, blocks * page_bytes / 2**30, 100 * blocks * page_bytes / available,
                            available / 2**30)
                self.graphchunk_config = dataclasses.replace(config, pool_tokens=blocks * block_size)
                self.model_runner.graphchunk_setup(self.graphchunk_config)
            return available - blocks * page_bytes

        def graphchunk_templates_manifest(self) -> dict | None:
            counts = self.model_runner.chunk_engine.counts
            return counts.manifest(vllm_graphs(self.vllm_config)) if counts is not None else None

        def graphchunk_stats(self) -> dict[str, float]:
            return self.model_runner.chunk_engine.stats()


    Worker.__module__, Worker.__qualname__ = "graphchunk", "Worker"
    return Worker
