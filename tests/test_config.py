import pytest

from graphchunk.config import ConfigError, GraphChunkConfig


def test_defaults_and_section():
    cfg = GraphChunkConfig.from_additional_config({"graphchunk": {"separator": " # # ", "max_chunks": 4}})
    assert (cfg.separator, cfg.max_chunks, cfg.mode) == (" # # ", 4, "auto")
    assert GraphChunkConfig().eviction == "gdsf"
    assert GraphChunkConfig.from_dict({"eviction": "lru"}).eviction == "lru"
    assert GraphChunkConfig.from_additional_config(None) == GraphChunkConfig()


@pytest.mark.parametrize("raw, message", [
    ({"max_chunk": 3}, "unknown graphchunk setting"),
    ({"max_chunks": 0}, "max_chunks must be >= 1"),
    ({"max_chunks": "8"}, "max_chunks must be int"),
    ({"pool_tokens": True}, "pool_tokens must be int"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"eviction": "fifo"}, r"graphchunk.eviction must be one of \('lru', 'lfu', 'gdsf'\), got 'fifo'"),
    ({"eviction": 1}, "graphchunk.eviction must be str, got 1"),
    ({"separator": 3}, "separator must be str"),
    ({"store_path": 1}, "graphchunk.store_path must be str, got 1"),
    ({"store_bytes": 0}, "graphchunk.store_bytes must be >= 1, got 0"),
    ({"blend_entries": "precompute"}, "blend_entries 'precompute' writes the entries it computes to the tier: set "
                                      "graphchunk.store_path"),
    ({"store_bytes": 1.5}, "graphchunk.store_bytes must be int"),
    ({"host_bytes": -1}, "graphchunk.host_bytes must be >= 0"),
    ({"host_bytes": 1.5}, "graphchunk.host_bytes must be int, got 1.5"),
    ({"recompute": "all"}, r"graphchunk.recompute\*: recompute policy must be one of \('none', 'cacheblend', 'legolink', 'question'\), got 'all'"),
    ({"recompute": 1}, "graphchunk.recompute must be str, got 1"),
    ({"recompute_ratio": 1.5}, r"recompute ratio must be a number in \[0, 1\], got 1.5"),
    ({"recompute_ratio": -0.01}, r"recompute ratio must be a number in \[0, 1\]"),
    ({"recompute_ratio": "0.1"}, "graphchunk.recompute_ratio must be a number, got '0.1'"),
    ({"recompute_ratio": True}, "graphchunk.recompute_ratio must be a number, got True"),
    ({"key_temperature": 0}, r"graphchunk.key_temperature must be a number > 0, got 0.0"),
    ({"key_temperature": -2}, r"graphchunk.key_temperature must be a number > 0"),
    ({"key_temperature": float("nan")}, r"graphchunk.key_temperature must be a number > 0"),
    ({"key_temperature": "1"}, "graphchunk.key_temperature must be a number, got '1'"),
    ({"recompute_tokens": -1}, "recompute tokens must be an integer >= 0, got -1"),
    ({"recompute_tokens": 2.5}, "graphchunk.recompute_tokens must be int, got 2.5"),
    ({"recompute_tokens": False}, "graphchunk.recompute_tokens must be int, got False"),
    ({"check_layer": -1}, "graphchunk.check_layer must be >= 0, got -1"),
    ({"check_layer": 1.0}, "graphchunk.check_layer must be int, got 1.0"),
    ({"check_layer": True}, "graphchunk.check_layer must be int, got True"),
])
def test_invalid_settings_name_the_problem(raw, message):
    with pytest.raises(ConfigError, match=message):
        GraphChunkConfig.from_dict(raw)


def test_host_memory_is_a_tier_of_its_own():
    """host_bytes alone is a tier (no directory); a store key still needs the directory it signs."""
    assert GraphChunkConfig.from_dict({"host_bytes": 1 << 30}).tiered
    assert GraphChunkConfig(store_path="/srv/t").tiered and not GraphChunkConfig().tiered
    with pytest.raises(ConfigError, match="store_key_file signs the persistent tier's files"):
        GraphChunkConfig(host_bytes=1 << 30, store_key_file="/etc/key")


def test_section_must_be_a_dict():
    with pytest.raises(ConfigError, match="must be a dict"):
        GraphChunkConfig.from_additional_config({"graphchunk": "yes"})


def test_blend_settings():
    cfg = GraphChunkConfig.from_dict({"mode": "blend", "recompute": "legolink", "recompute_ratio": 1,
                                      "recompute_tokens": 0, "check_layer": 0})
    assert (cfg.mode, cfg.recompute, cfg.recompute_tokens, cfg.check_layer) == ("blend", "legolink", 0, 0)
    assert cfg.recompute_ratio == 1.0 and isinstance(cfg.recompute_ratio, float)  # an int ratio becomes a float
    assert cfg.policy.describe() == "legolink:0"
    default = GraphChunkConfig()
    assert (default.recompute, default.recompute_ratio, default.recompute_tokens, default.check_layer) == \
        ("question", 0.3, 15, 1)
    assert default.policy.describe() == "question:0.3x4"
