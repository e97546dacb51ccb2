"""Start-up checks of graphchunk.Runner: misconfigurations fail before the first step."""
from types import SimpleNamespace

import pytest

from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.engine.worker import check_config


_GRAPHCHUNK_CONNECTOR = SimpleNamespace(kv_connector="GraphChunkConnector", has_connector=lambda name: name == "GraphChunkConnector",
                                        kv_load_failure_policy="fail")


def vllm_config(**overrides):
    config = dict(use_v2_model_runner=False, pp=1, dp=1, moe=False, speculative_config=None, lora_config=None, block_size=32,
                  cache_dtype="auto", max_model_len=2048, hf_config=SimpleNamespace(rope_theta=1e4))
    config.update(overrides)
    rope = getattr(config["hf_config"], "rope_parameters", None) or {}
    return SimpleNamespace(
        use_v2_model_runner=config["use_v2_model_runner"],
        parallel_config=SimpleNamespace(pipeline_parallel_size=config["pp"], data_parallel_size=config["dp"]),
        speculative_config=config["speculative_config"],
        lora_config=config["lora_config"],
        cache_config=SimpleNamespace(block_size=config["block_size"], cache_dtype=config["cache_dtype"]),
        kv_transfer_config=config.get("kv_transfer_config", _GRAPHCHUNK_CONNECTOR),
        model_config=SimpleNamespace(max_model_len=config["max_model_len"], hf_config=config["hf_config"], is_moe=config["moe"],
                                     uses_mrope="mrope_section" in rope,  # as vLLM's ModelConfig decides
                                     using_transformers_backend=lambda: config.get("transformers_backend", False)),
    )


def test_valid_config_passes():
    check_config(vllm_config(), GraphChunkConfig(pool_tokens=4096, max_chunk_len=512))


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_a_vllm_outside_the_supported_releases_is_refused(monkeypatch, version):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(ConfigError, match=rf"graphchunk supports vLLM 0.32 and 0.33; this is vLLM {version}"):
        check_config(vllm_config(), GraphChunkConfig(pool_tokens=4096, max_chunk_len=512))


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.1+cu130", "0.33.0rc1"])
def test_the_supported_releases_pass(monkeypatch, version):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    check_config(vllm_config(), GraphChunkConfig(pool_tokens=4096, max_chunk_len=512))


@pytest.mark.parametrize("overrides, gc, message", [
    ({"use_v2_model_runner": True}, {}, "V1 model runner"),
    ({"pp": 2}, {}, "pipeline parallelism"),
    ({"speculative_config": object()}, {}, "speculative decoding"),
    ({}, {"pool_tokens": 2048, "max_chunk_len": 512}, "pool_tokens=2048 is too small"),
    ({"dp": 2, "moe": True}, {}, r"data parallelism \(data_parallel_size=2\) for a mixture-of-experts model"),
    ({"lora_config": object()}, {}, r"LoRA \(enable_lora\)"),
    ({"cache_dtype": "fp8"}, {}, r"quantized KV cache, kv_cache_dtype='fp8' \(--kv-cache-dtype"),
    ({"cache_dtype": "fp8_e5m2"}, {}, r"quantized KV cache, kv_cache_dtype='fp8_e5m2' \(--kv-cache-dtype"),
    ({"hf_config": SimpleNamespace(rope_theta=1e4, rope_parameters={"rope_type": "default",
                                                                    "mrope_section": [16, 24, 24]})},
     {}, r"M-RoPE .*uses_mrope"),
])
def test_misconfigurations_are_named(overrides, gc, message):
    with pytest.raises(ConfigError, match=message):
        check_config(vllm_config(**overrides), GraphChunkConfig(**{"pool_tokens": 65536, **gc}))


def tiny_with_config(directory, arch: str, rope: dict | None = None, **changes):
    """A tiny checkpoint's files under ``directory`` with its config.json changed by ``changes``
    (and ``rope`` merged into its rope parameters)."""
    import json

    from graphchunk.reference import models

    tiny = models.tiny_checkpoint(arch)
    directory.mkdir()
    for path in tiny.iterdir():
        if path.name != "config.json":
            (directory / path.name).symlink_to(path)
    config = json.loads((tiny / "config.json").read_text())
    config.update(changes)
    if rope:
        config["rope_parameters"] = {**config["rope_parameters"], **rope}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def mrope_checkpoint(directory, section_key: str):
    """The tiny Qwen2 checkpoint with an M-RoPE section in its rope parameters: the key vLLM reads
    in a Qwen2-VL / Qwen2.5-VL text config (``mrope_section``) or HunYuan-VL's (``xdrope_section``)."""
    return tiny_with_config(directory, "qwen2", rope={section_key: [4, 6, 6]})


def moe_checkpoint(directory):
    """The tiny Llama checkpoint's files under a Mixtral config (two experts): what vLLM reads as a
    mixture-of-experts model (``model_config.is_moe``); only its config is read here."""
    return tiny_with_config(directory, "llama3", architectures=["MixtralForCausalLM"], model_type="mixtral",
                            num_local_experts=2, num_experts_per_tok=1,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})


@pytest.mark.parametrize("setting, message", [
    ({"model": "moe", "data_parallel_size": 2}, r"data parallelism \(data_parallel_size=2\) for a mixture-of-experts"),
    ({"enable_lora": True}, r"LoRA \(enable_lora\)"),
    ({"kv_cache_dtype": "fp8"}, r"quantized KV cache, kv_cache_dtype='fp8' \(--kv-cache-dtype"),
    ({"model": "mrope_section"}, r"M-RoPE .*uses_mrope"),
    ({"model": "xdrope_section"}, r"M-RoPE .*uses_mrope"),
])
def test_unsupported_vllm_settings_are_refused_where_the_config_is_built(setting, message, tmp_path):
    """Real EngineArgs, built as ``vllm serve`` / ``LLM`` build them (no engine is started): the
    plugin's create_engine_config wrapper refuses each in the user's process, by setting."""
    from vllm.engine.arg_utils import EngineArgs

    from graphchunk.engine.plugin import register
    from graphchunk.reference import models

    register()
    if setting.get("model") == "moe":
        setting = {**setting, "model": str(moe_checkpoint(tmp_path / "moe"))}
    elif "model" in setting:
        setting = {"model": str(mrope_checkpoint(tmp_path / "mrope", setting["model"]))}
    args = {"model": str(models.tiny_checkpoint("llama3")), "dtype": "float32", "max_model_len": 1024,
            "kv_cache_memory_bytes": 1 << 28, **setting}
    with pytest.raises(ConfigError, match=message):
        EngineArgs(worker_cls="graphchunk.Runner", additional_config={"graphchunk": {"pool_tokens": 4096}},
                   **args).create_engine_config()
    if "model" in setting and "data_parallel_size" not in setting:  # vLLM reads the same config as M-RoPE
        config = EngineArgs(**args).create_engine_config()
        assert config.model_config.uses_mrope


def test_an_engine_serving_clients_refuses_the_precompute_engine_s_setting(tmp_path):
    """``blend_entries`` 'precompute' lets a request choose the context of the entries unsalted
    requests read: ``vllm serve``'s AsyncEngineArgs refuse it; the offline ``LLM``'s build it."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    from graphchunk.engine.plugin import register
    from graphchunk.reference import models

    register()
    args = dict(model=str(models.tiny_checkpoint("llama3")), dtype="float32", max_model_len=1024,
                kv_cache_memory_bytes=1 << 28, worker_cls="graphchunk.Runner",
                additional_config={"graphchunk": {"pool_tokens": 4096, "blend_entries": "precompute",
                                                  "store_path": str(tmp_path)}})
    with pytest.raises(ConfigError, match="graphchunk-precompute's offline setting: on an engine serving clients"):
        AsyncEngineArgs(**args).create_engine_config()
    assert EngineArgs(**args).create_engine_config().parallel_config.worker_cls == "graphchunk.Runner"


def test_data_parallelism_of_a_dense_model_is_built_and_logged(caplog):
    """Real EngineArgs with --data-parallel-size 2 on a dense model: the config is built (vLLM
    runs each rank as an independent engine, each with its own pool), and the start-up log says so."""
    import logging

    from vllm.engine.arg_utils import EngineArgs

    from graphchunk.engine.plugin import register
    from graphchunk.reference import models

    register()
    with caplog.at_level(logging.INFO, logger="vllm.graphchunk"):
        config = EngineArgs(model=str(models.tiny_checkpoint("llama3")), dtype="float32", max_model_len=1024,
                            kv_cache_memory_bytes=1 << 28, data_parallel_size=2, worker_cls="graphchunk.Runner",
                            additional_config={"graphchunk": {"pool_tokens": 4096}}).create_engine_config()
    assert config.parallel_config.data_parallel_size == 2 and not config.model_config.is_moe
    assert "each engine core has its own chunk pool and KV connector" in caplog.text


@pytest.mark.parametrize("hf_config, reason", [
    (SimpleNamespace(rope_theta=1e4, rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic NTK"),
    (SimpleNamespace(), "no rotary position embedding"),
    (SimpleNamespace(rope_theta=1e4, rope_parameters={"rope_type": "longrope"}), "'longrope' is not known"),
])
def test_blend_default_refuses_moving_keys_it_cannot(hf_config, reason):
    with pytest.raises(ConfigError, match=reason):
        check_config(vllm_config(hf_config=hf_config), GraphChunkConfig(pool_tokens=65536, mode="blend"))
    check_config(vllm_config(hf_config=hf_config), GraphChunkConfig(pool_tokens=65536))  # auto: isolated for this model


def test_blend_default_refused_where_vllm_runs_hfs_own_modules():
    """vLLM's Transformers modeling backend (OLMo-2 in vLLM 0.32) runs HF's rotary module, which the
    worker's key rotation does not read, whatever the config's rope_type: blend is refused by name."""
    with pytest.raises(ConfigError, match="blend' is not available .* Transformers modeling backend"):
        check_config(vllm_config(transformers_backend=True), GraphChunkConfig(pool_tokens=65536, mode="blend"))
    check_config(vllm_config(transformers_backend=True), GraphChunkConfig(pool_tokens=65536))  # auto: isolated
    check_config(vllm_config(), GraphChunkConfig(pool_tokens=65536, mode="blend"))  # vLLM's own modeling class


def test_key_temperature_default_refused_where_keys_do_not_scale_logits():
    capped = SimpleNamespace(rope_theta=1e4, attn_logit_softcapping=50.0)
    with pytest.raises(ConfigError, match=r"graphchunk.key_temperature=0.8 is not available .* soft-capped"):
        check_config(vllm_config(hf_config=capped), GraphChunkConfig(pool_tokens=65536, key_temperature=0.8))
    check_config(vllm_config(hf_config=capped), GraphChunkConfig(pool_tokens=65536))  # T = 1 is plain isolated


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_blend_default_accepts_fixed_rotations(rope_type):
    hf_config = SimpleNamespace(rope_theta=1e4, rope_parameters={"rope_type": rope_type, "factor": 2.0})
    check_config(vllm_config(hf_config=hf_config), GraphChunkConfig(pool_tokens=65536, mode="blend"))


def test_graphchunk_engines_select_the_v1_model_runner(monkeypatch):
    """The selection a CUDA install makes (Triton importable: vLLM 0.32 defaults to its V2 runner),
    exercised on CPU: a graphchunk engine's config selects V1, another engine's keeps V2, and
    VLLM_USE_V2_MODEL_RUNNER=1 still forces V2, which the worker then refuses by name."""
    import vllm.config.vllm as vllm_config_module
    from vllm import envs
    from vllm.config import ParallelConfig, VllmConfig

    from graphchunk.engine.plugin import register

    register()
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None, raising=False)
    graphchunk_engine = VllmConfig(parallel_config=ParallelConfig(worker_cls="graphchunk.Runner"))
    other_engine = VllmConfig(parallel_config=ParallelConfig(worker_cls="auto"))
    assert graphchunk_engine.use_v2_model_runner is False
    assert other_engine.use_v2_model_runner is True
    # The reason vLLM logs ("Model Runner V2 does not yet support <reason>; using the V1 model runner
    # instead") names what V1 costs, read from the installed vLLM's own V1 check.
    (reason,) = [r for r in graphchunk_engine._get_v2_model_runner_unsupported_features() if "graphchunk" in r]
    assert reason.startswith("graphchunk's chunk-aware model runner (--worker-cls graphchunk.Runner extends the V1 "
                             "runner; V1 refuses prefill context parallel, pipeline parallelism with async scheduling")
    assert "batch-sharded sampling" in reason and reason.endswith(")")
    assert not [r for r in other_engine._get_v2_model_runner_unsupported_features() if "graphchunk" in r]
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", True, raising=False)
    assert graphchunk_engine.use_v2_model_runner is True
    with pytest.raises(ConfigError, match=r"selects V2: VLLM_USE_V2_MODEL_RUNNER=1, or a setting with which vLLM "
                                          r"selects V2 .*unset VLLM_USE_V2_MODEL_RUNNER \(a graphchunk engine cannot "
                                          r"use what V1 refuses: prefill context parallel, "):
        check_config(graphchunk_engine, GraphChunkConfig())


def test_the_features_v1_refuses_are_read_from_vllms_own_check():
    """What vLLM's V1 check returns for a configuration using everything it checks is among what the
    plugin reads from that check's source (so the start-up line misses none of them)."""
    from vllm.config import VllmConfig

    from graphchunk.engine.plugin import v1_refused_features

    spec = SimpleNamespace(method="dspark", is_xpress=lambda: False, enable_adaptive_verification=True,
                           draft_lm_head_quantization=None, draft_model_config=None)
    everything = SimpleNamespace(
        parallel_config=SimpleNamespace(prefill_context_parallel_size=2, pipeline_parallel_size=2,
                                        enable_batch_sharded_sampling=True),
        scheduler_config=SimpleNamespace(async_scheduling=True), speculative_config=spec,
        model_config=SimpleNamespace(is_diffusion=True, architecture="Step5ForCausalLM"),
        _dflash_needs_multi_kv_group=lambda: True, _is_dflash_candidate_draft=lambda: True)
    refused_now = VllmConfig._get_v1_model_runner_unsupported_features(everything)
    assert "prefill context parallel" in refused_now and len(refused_now) >= 8
    assert set(refused_now) <= set(v1_refused_features())


def test_the_v1_reader_takes_literal_appends_in_source_order(monkeypatch):
    from vllm.config import VllmConfig

    from graphchunk.engine import plugin

    def fake_check(self):
        unsupported = []
        if self.a:
            if self.b:
                unsupported.append("nested first")
            unsupported.append(f"computed {self.c}")  # not a literal: left out
        other = []
        other.append("second")  # any list's literal append counts: vLLM's check appends only to its result
        unsupported.extend(["extended"])  # not an append: left out
        unsupported.append("nested first")  # named once
        return unsupported

    monkeypatch.setattr(VllmConfig, "_get_v1_model_runner_unsupported_features", fake_check, raising=False)
    assert plugin.v1_refused_features() == ("nested first", "second")
    monkeypatch.delattr(VllmConfig, "_get_v1_model_runner_unsupported_features")
    assert plugin.v1_refused_features() == ()
    assert plugin.v1_reason().endswith("extends the V1 runner; the features V1 refuses could not be read from "
                                       "this vLLM's source)")


def test_a_refused_configuration_raises_in_the_users_process(smollm2_path):
    """Where the engine's config is built (the plugin wraps EngineArgs.create_engine_config), not
    in a worker whose failure would surface as "Engine core initialization failed"."""
    from graphchunk import GraphChunkLLM

    with pytest.raises(ConfigError, match="graphchunk.pool_tokens=64 is too small"):
        GraphChunkLLM(str(smollm2_path), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30,
                      graphchunk={"pool_tokens": 64})


def test_a_pool_larger_than_the_kv_cache_is_refused_in_the_users_process(smollm2_path):
    """SmolLM2 in fp32 holds 46080 bytes of KV per token: 65536 pool tokens need 2.8 GiB."""
    from graphchunk import GraphChunkLLM

    with pytest.raises(ConfigError, match=r"pool_tokens=65536 needs 3019898880 bytes .*--kv-cache-memory-bytes "
                                          r"is 1073741824"):
        GraphChunkLLM(str(smollm2_path), dtype="float32", kv_cache_memory_bytes=1 << 30,
                      graphchunk={"pool_tokens": 65536})


def test_store_path_is_checked_at_start_up(tmp_path):
    from graphchunk.reference import models

    (tmp_path / "a-file").write_bytes(b"")
    config = vllm_config()
    config.model_config.model, config.model_config.revision = str(models.tiny_checkpoint("llama3")), None
    with pytest.raises(ConfigError, match="store_path=.*not a writable directory"):
        check_config(config, GraphChunkConfig(store_path=str(tmp_path / "a-file" / "tier")))
    check_config(config, GraphChunkConfig(store_path=str(tmp_path / "tier")))
    assert (tmp_path / "tier").is_dir()
    config.model_config.model = "some-org/not-downloaded"
    with pytest.raises(ConfigError, match="weights on local disk"):
        check_config(config, GraphChunkConfig(store_path=str(tmp_path / "tier")))


def test_the_cuda_worker_builds_the_chunk_runner_through_its_hook(monkeypatch):
    """vLLM's CUDA Worker builds its model runner in ``_make_model_runner`` (called from
    ``init_device``): graphchunk's worker builds the chunk-aware runner there, set up, with no
    class swap. CPUWorker builds its runner inline in ``init_device`` without calling the hook, so
    its worker keeps the swap after ``init_device`` (the engine tests run that path)."""
    import graphchunk.engine.worker as worker
    from graphchunk.engine.model_runner import ChunkModelRunner
    from graphchunk.metrics import METRICS_FILE_ENV
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    built = []
    monkeypatch.delenv(METRICS_FILE_ENV, raising=False)
    monkeypatch.setattr(gpu_model_runner.GPUModelRunner, "__init__",
                        lambda self, config, device: built.append((config, device)))
    monkeypatch.setattr(worker, "platform_worker_class", lambda: Worker)
    cuda_runner = worker.make_worker_class()
    cuda_worker = object.__new__(cuda_runner)  # the attributes Worker.init_device has set by then
    cuda_worker.vllm_config, cuda_worker.device, cuda_worker.use_v2_model_runner = "config", "cuda:0", False
    cuda_worker.graphchunk_config = GraphChunkConfig(pool_tokens=4096)
    runner = cuda_worker._make_model_runner()
    assert isinstance(runner, gpu_model_runner.GPUModelRunner) and isinstance(runner, ChunkModelRunner)
    assert built == [("config", "cuda:0")]
    assert runner.graphchunk_config is cuda_worker.graphchunk_config and runner.chunk_engine is None  # set up
    assert issubclass(cuda_runner, Worker) and "init_device" not in vars(cuda_runner)  # no class swap

    monkeypatch.setattr(worker, "platform_worker_class", lambda: CPUWorker)
    cpu_runner = worker.make_worker_class()
    assert "init_device" in vars(cpu_runner) and "_make_model_runner" not in vars(cpu_runner)


@pytest.mark.parametrize("pool_tokens, budget, expected, message", [
    (0, 100 * 4096, 50, None),              # unset: half the budget, in whole blocks
    ((0, 1 << 30), 100 * 4096, 25, None),   # unset, host memory below the pool: a quarter
    (0, 100 * 4096 + 4095, 50, None),       # a partial block is not a block
    (0, 30 * 4096, 20, None),               # half is below what one unit of chunk work needs: the minimum
    (0, 20 * 4096, None, r"pool \(pool_tokens unset\) must hold .* 640 tokens, and needs 81920 bytes of KV cache "
                         r"but the budget is 81920: raise it, or lower --max-model-len"),
    (1000, 100 * 4096, 32, None),           # set: its own blocks, 1000 tokens in blocks of 32
    (4096, 100 * 4096, None, r"graphchunk.pool_tokens=4096 needs 524288 bytes of KV cache but the budget is 409600"),
])
def test_the_pool_is_sized_inside_the_kv_cache_budget(pool_tokens, budget, expected, message):
    from graphchunk.engine.worker import pool_blocks_in

    pool_tokens, host_bytes = pool_tokens if isinstance(pool_tokens, tuple) else (pool_tokens, 0)
    config = GraphChunkConfig(pool_tokens=pool_tokens, host_bytes=host_bytes)
    size = lambda: pool_blocks_in(budget, 4096, 20, config, 32, "the budget")  # noqa: E731
    if message:
        with pytest.raises(ConfigError, match=message):
            size()
    else:
        assert size() == expected
