"""Start-up checks of graphchunk.Runner: misconfigurations fail before the first step."""
from types import SimpleNamespace

import pytest

from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.engine.worker import check_config


def vllm_config(**overrides):
    config = dict(use_v2_model_runner=False, pp=1, speculative_config=None, block_size=32, max_model_len=2048)
    config.update(overrides)
    return SimpleNamespace(
        use_v2_model_runner=config["use_v2_model_runner"],
        parallel_config=SimpleNamespace(pipeline_parallel_size=config["pp"]),
        speculative_config=config["speculative_config"],
        cache_config=SimpleNamespace(block_size=config["block_size"]),
        model_config=SimpleNamespace(max_model_len=config["max_model_len"],
                                     hf_config=config.get("hf_config", SimpleNamespace(rope_theta=1e4))),
    )


def test_valid_config_passes():
    check_config(vllm_config(), GraphChunkConfig(pool_tokens=4096, max_chunk_len=512))


@pytest.mark.parametrize("overrides, gc, message", [
    ({"use_v2_model_runner": True}, {}, "V1 model runner"),
    ({"pp": 2}, {}, "pipeline parallelism"),
    ({"speculative_config": object()}, {}, "speculative decoding"),
    ({}, {"pool_tokens": 2048, "max_chunk_len": 512}, "pool_tokens=2048 is too small"),
])
def test_misconfigurations_are_named(overrides, gc, message):
    with pytest.raises(ConfigError, match=message):
        check_config(vllm_config(**overrides), GraphChunkConfig(**{"pool_tokens": 65536, **gc}))


@pytest.mark.parametrize("hf_config, reason", [
    (SimpleNamespace(rope_theta=1e4, rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic NTK"),
    (SimpleNamespace(), "no rotary position embedding"),
    (SimpleNamespace(rope_theta=1e4, rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24]}),
     "M-RoPE"),
    (SimpleNamespace(rope_theta=1e4, rope_parameters={"rope_type": "longrope"}), "'longrope' is not known"),
])
def test_blend_default_refuses_moving_keys_it_cannot(hf_config, reason):
    with pytest.raises(ConfigError, match=reason):
        check_config(vllm_config(hf_config=hf_config), GraphChunkConfig(pool_tokens=65536, mode="blend"))
    check_config(vllm_config(hf_config=hf_config), GraphChunkConfig(pool_tokens=65536))  # isolated is fine


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
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", True, raising=False)
    assert graphchunk_engine.use_v2_model_runner is True
    with pytest.raises(ConfigError, match="selects V2 .*unset VLLM_USE_V2_MODEL_RUNNER"):
        check_config(graphchunk_engine, GraphChunkConfig())


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
