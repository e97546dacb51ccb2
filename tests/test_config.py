import pytest

from graphchunk.config import ConfigError, GraphChunkConfig


def test_defaults_and_section():
    cfg = GraphChunkConfig.from_additional_config({"graphchunk": {"separator": " # # ", "max_chunks": 4}})
    assert (cfg.separator, cfg.max_chunks, cfg.mode) == (" # # ", 4, "isolated")
    assert GraphChunkConfig.from_additional_config(None) == GraphChunkConfig()


@pytest.mark.parametrize("raw, message", [
    ({"max_chunk": 3}, "unknown graphchunk setting"),
    ({"max_chunks": 0}, "max_chunks must be >= 1"),
    ({"max_chunks": "8"}, "max_chunks must be int"),
    ({"pool_tokens": True}, "pool_tokens must be int"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"separator": 3}, "separator must be str"),
])
def test_invalid_settings_name_the_problem(raw, message):
    with pytest.raises(ConfigError, match=message):
        GraphChunkConfig.from_dict(raw)


def test_section_must_be_a_dict():
    with pytest.raises(ConfigError, match="must be a dict"):
        GraphChunkConfig.from_additional_config({"graphchunk": "yes"})
