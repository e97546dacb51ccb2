"""Start-up checks of graphchunk.Runner: misconfigurations fail before the first step."""
from types import SimpleNamespace

import pytest

from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.worker import check_config


def vllm_config(**overrides):
    config = dict(use_v2_model_runner=False, pp=1, speculative_config=None, block_size=32, max_model_len=2048)
    config.update(overrides)
    return SimpleNamespace(
        use_v2_model_runner=config["use_v2_model_runner"],
        parallel_config=SimpleNamespace(pipeline_parallel_size=config["pp"]),
        speculative_config=config["speculative_config"],
        cache_config=SimpleNamespace(block_size=config["block_size"]),
        model_config=SimpleNamespace(max_model_len=config["max_model_len"]),
    )


def test_valid_config_passes():
    check_config(vllm_config(), GraphChunkConfig(pool_tokens=4096, max_chunk_len=512))


@pytest.mark.parametrize("overrides, gc, message", [
    ({"use_v2_model_runner": True}, {}, "V1 model runner"),
    ({"pp": 2}, {}, "pipeline parallelism"),
    ({"speculative_config": object()}, {}, "speculative decoding"),
    ({}, {"mode": "blend"}, "not available yet"),
    ({}, {"pool_tokens": 2048, "max_chunk_len": 512}, "pool_tokens=2048 is too small"),
])
def test_misconfigurations_are_named(overrides, gc, message):
    with pytest.raises(ConfigError, match=message):
        check_config(vllm_config(**overrides), GraphChunkConfig(**{"pool_tokens": 65536, **gc}))
