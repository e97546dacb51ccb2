"""The persistent chunk tier's files: round trip, every fault a file can have, concurrent writers,
the budget, and the model identity (``graphchunk/cache/store.py``)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
import torch

from graphchunk.cache.store import (FORMAT_VERSION, ChunkStore, StoreIdentity, prepare_directory, read_store_key,
                                    weights_digest)
from graphchunk.cache.tier import Tier
from graphchunk.config import ConfigError
from graphchunk.metrics import CacheMetrics

LAYERS, BLOCK = 3, [2, 4, 8]  # a block of one layer: e.g. K/V x block_size x head_size
IDENTITY = StoreIdentity(model_path="/models/m", weights_digest="d1", kv_dtype="torch.bfloat16",
                         kv_layout="CPUAttn block [2, 4, 8]", block_size=4, parallel="tp1-pp1 rank 0")
KEY, TOKENS = bytes(range(16)), (5, 6, 7, 8, 9)


def store(root, identity=IDENTITY, budget=1 << 30, mac_key=None) -> ChunkStore:
    return ChunkStore(root, budget, identity, LAYERS, BLOCK, mac_key=mac_key)


def payload(num_blocks=2, seed=0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, num_blocks, *BLOCK, generator=g).to(dtype)


def saved(tmp_path, data=None, **kwargs):
    s = store(tmp_path, **kwargs)
    s.save(KEY, TOKENS, len(TOKENS), "isolated", payload() if data is None else data)
    return s, s.path_of(KEY)


def test_round_trip_is_bit_exact(tmp_path):
    s, path = saved(tmp_path)
    got = s.load(KEY, TOKENS, "isolated", 2)
    assert torch.equal(got.view(torch.int16), payload().view(torch.int16))
    assert path.suffix == ".gckv" and path.parent.parent == tmp_path
    assert (s.metrics.tier_writes, s.metrics.tier_rejected) == (1, 0)
    assert s.metrics.tier_bytes_read == s.metrics.tier_bytes_written == path.stat().st_size


def test_missing_file_is_a_plain_miss(tmp_path):
    s = store(tmp_path)
    assert s.load(KEY, TOKENS, "isolated", 2) is None
    assert s.metrics.tier_rejected == 0


@pytest.mark.parametrize("cut", [0, 5, 11, 40, -17, -1])
def test_truncated_file_is_rejected_and_removed(tmp_path, cut):
    s, path = saved(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:cut] if cut > 0 else raw[:len(raw) + cut] if cut < 0 else b"")
    assert s.load(KEY, TOKENS, "isolated", 2) is None
    assert s.metrics.tier_rejected == 1
    assert not path.exists()


@pytest.mark.parametrize("where", ["magic", "header", "payload", "checksum"])
def test_corrupt_file_is_rejected_and_removed(tmp_path, where):
    s, path = saved(tmp_path)
    raw = bytearray(path.read_bytes())
    header_len = struct.unpack_from("<I", raw, 8)[0]
    offset = {"magic": 0, "header": 12 + header_len // 2, "payload": 12 + header_len + 100, "checksum": len(raw) - 3}
    raw[offset[where]] ^= 0x40
    path.write_bytes(bytes(raw))
    assert s.load(KEY, TOKENS, "isolated", 2) is None
    assert s.metrics.tier_rejected == 1
    assert not path.exists()


@pytest.mark.parametrize("field,value", [("weights_digest", "d2"), ("kv_dtype", "torch.float32"),
                                         ("kv_layout", "CPUAttn block [2, 8, 4]"), ("block_size", 8),
                                         ("parallel", "tp2-pp1 rank 0")])
def test_another_engines_file_is_ignored_not_removed(tmp_path, field, value):
    """Same file name (key and rank), written by an engine that differs in one respect: never
    served; left in place (it may be another server's)."""
    other = dataclasses.replace(IDENTITY, **{field: value})
    _, path = saved(tmp_path, identity=other)
    s = store(tmp_path)
    assert s.load(KEY, TOKENS, "isolated", 2) is None
    assert s.metrics.tier_rejected == 1
    assert path.exists()


def test_model_path_alone_does_not_matter(tmp_path):
    """The same weights at another path (another server's mount) are the same model."""
    saved(tmp_path, identity=dataclasses.replace(IDENTITY, model_path="/mnt/elsewhere/m"))
    assert store(tmp_path).load(KEY, TOKENS, "isolated", 2) is not None


def test_newer_format_version_is_ignored(tmp_path):
    s, path = saved(tmp_path)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 4, FORMAT_VERSION + 1)
    path.write_bytes(bytes(raw))
    assert s.load(KEY, TOKENS, "isolated", 2) is None
    assert s.metrics.tier_rejected == 1 and path.exists()


@pytest.mark.parametrize("tokens,mode,blocks", [((5, 6, 7, 8, 10), "isolated", 2), (TOKENS, "blend", 2),
                                                (TOKENS, "isolated", 3)])
def test_other_tokens_mode_or_shape_under_the_same_name_are_not_served(tmp_path, tokens, mode, blocks):
    s, path = saved(tmp_path)
    assert s.load(KEY, tokens, mode, blocks) is None
    assert s.metrics.tier_rejected == 1 and path.exists()


def test_unreadable_file_is_skipped(tmp_path):
    s = store(tmp_path)
    s.path_of(KEY).mkdir(parents=True)  # open() fails with an OSError (as for EIO or EACCES)
    assert s.load(KEY, TOKENS, "isolated", 2) is None
    assert s.metrics.tier_rejected == 1 and s.path_of(KEY).is_dir()


def test_a_failed_write_is_counted_not_raised(tmp_path):
    s = store(tmp_path)
    blocker = tmp_path / KEY.hex()[:2]
    blocker.write_bytes(b"")  # a file where the entry's subdirectory should go
    s.save(KEY, TOKENS, len(TOKENS), "isolated", payload())
    assert (s.metrics.tier_writes, s.metrics.tier_write_errors) == (0, 1)
    assert s.load(KEY, TOKENS, "isolated", 2) is None


def _write_many(root: str, seed: int, rounds: int) -> int:
    s = store(root)
    for i in range(rounds):
        s.save(KEY, TOKENS, len(TOKENS), "isolated", payload(seed=seed * 1000 + i))
    return rounds


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    """Two processes rewrite the same entry with different payloads while this one reads it:
    every read is one writer's complete payload, never rejected."""
    valid = {payload(seed=seed * 1000 + i).view(torch.int16).numpy().tobytes()
             for seed in (1, 2) for i in range(40)}
    reader = store(tmp_path)
    reads = 0
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        writers = [pool.submit(_write_many, str(tmp_path), seed, 40) for seed in (1, 2)]
        while not all(w.done() for w in writers) or reads == 0:
            got = reader.load(KEY, TOKENS, "isolated", 2)
            if got is not None:
                assert got.view(torch.int16).numpy().tobytes() in valid
                reads += 1
        assert [w.result() for w in writers] == [40, 40]
    assert reader.metrics.tier_rejected == 0
    assert reads > 0
    assert not list(tmp_path.rglob("*.tmp"))


def test_budget_evicts_least_recently_used_files(tmp_path):
    s = store(tmp_path)
    s.save(KEY, TOKENS, len(TOKENS), "isolated", payload())
    size = s.path_of(KEY).stat().st_size
    s = store(tmp_path, budget=int(size * 3.5))
    keys = [bytes([i]) * 16 for i in range(6)]
    for i, key in enumerate(keys):
        s.save(key, TOKENS, len(TOKENS), "isolated", payload(seed=i))
        os.utime(s.path_of(key), (time.time() - 100 + i, time.time() - 100 + i))
        if i == 1:
            os.utime(s.path_of(KEY), (time.time() - 200, time.time() - 200))
        if i == 2:
            assert s.load(keys[0], TOKENS, "isolated", 2) is not None  # a hit makes it recent
    present = {key for key in [KEY, *keys] if s.path_of(key).exists()}
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.gckv")) <= 3.5 * size
    assert KEY not in present and keys[1] not in present  # the oldest went first
    assert keys[0] in present  # older than keys[2..4], but loaded since
    assert keys[5] in present and s.metrics.tier_evictions >= 3
    assert s.metrics.tier_bytes == sum(p.stat().st_size for p in tmp_path.rglob("*.gckv"))


def test_stale_temporary_files_are_cleaned_up(tmp_path):
    stale = tmp_path / "ab" / ".x.gckv.123.tmp"
    stale.parent.mkdir()
    stale.write_bytes(b"half a file")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = tmp_path / "ab" / ".y.gckv.456.tmp"
    fresh.write_bytes(b"being written")
    store(tmp_path)
    assert not stale.exists() and fresh.exists()


def test_unwritable_store_path_is_a_config_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="store_path=.*not a writable directory"):
        prepare_directory(tmp_path / "file" / "store")


def test_weights_digest_follows_the_weights_not_the_path(tmp_path):
    from graphchunk.reference import models

    original = models.tiny_checkpoint("llama3")
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert weights_digest(str(copy)) == weights_digest(str(original))
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-5) * 2
    (copy / "config.json").write_text(json.dumps(config))
    assert weights_digest(str(copy)) != weights_digest(str(original))
    with pytest.raises(ConfigError, match="weights on local disk"):
        weights_digest("no-such-org/no-such-model")


# --- the directory as the workers see it (tier.py) ------------------------------------------------

def test_a_rank_serves_from_the_directory_only_when_every_rank_found_its_file(tmp_path):
    """With tensor parallelism the ranks' answers are joined (``all_ranks``): one rank's miss makes
    every rank compute the entry, so a rank that holds it serves nothing and counts no load."""
    metrics, asked = CacheMetrics(), []
    others_found = [True]

    def all_ranks(found: bool) -> bool:
        asked.append(found)
        return found and others_found[0]

    tier = Tier(ChunkStore(tmp_path, 1 << 30, IDENTITY, LAYERS, BLOCK, metrics), metrics, all_ranks=all_ranks)
    tier.save(KEY, TOKENS, len(TOKENS), "isolated", payload())
    assert torch.equal(tier.load(KEY, TOKENS, "isolated", 2), payload())
    others_found[0] = False
    assert tier.load(KEY, TOKENS, "isolated", 2) is None
    assert tier.load(bytes(16), TOKENS, "isolated", 2) is None  # a miss here joins the collective too
    assert asked == [True, True, False] and metrics.tier_loads == 1


def _forged(path, data: torch.Tensor) -> None:
    """Rewrites a tier file's payload as a writer without the store key can: the unkeyed checksum
    recomputed over the new bytes."""
    import xxhash

    raw = bytearray(path.read_bytes())
    header_len = struct.unpack_from("<4sII", raw)[2]
    start = 12 + header_len
    new = data.contiguous().view(torch.uint8).numpy().tobytes()
    raw[start:start + len(new)] = new
    raw[-16:] = xxhash.xxh3_128_digest(bytes(raw[12:-16]))
    path.write_bytes(bytes(raw))


def test_unkeyed_files_can_be_forged_keyed_ones_cannot(tmp_path):
    """Without a store key a writer that knows a document shapes what requests read: a payload it
    replaced, checksum recomputed, is served. With one (``store_key_file``) the same forgery is
    refused (counted, not removed), and a keyed server's own files round-trip."""
    s, path = saved(tmp_path / "plain")
    _forged(path, payload(seed=7))
    assert torch.equal(s.load(KEY, TOKENS, "isolated", 2), payload(seed=7))  # the forgery is served
    key = read_store_key(_key_file(tmp_path, b"k" * 32))
    signed, path = saved(tmp_path / "keyed", mac_key=key)
    assert torch.equal(signed.load(KEY, TOKENS, "isolated", 2), payload())
    _forged(path, payload(seed=7))
    assert signed.load(KEY, TOKENS, "isolated", 2) is None and signed.metrics.tier_rejected == 1 and path.exists()


def test_a_file_made_under_another_key_or_none_is_not_served(tmp_path):
    one, two = (read_store_key(_key_file(tmp_path, secret)) for secret in (b"a" * 32, b"b" * 32))
    _, path = saved(tmp_path, mac_key=one)
    for reader in (store(tmp_path, mac_key=two), store(tmp_path)):  # another key; none
        assert reader.load(KEY, TOKENS, "isolated", 2) is None and reader.metrics.tier_rejected == 1
        assert path.exists()  # another deployment's file, not a corrupt one
    store(tmp_path).save(KEY, TOKENS, len(TOKENS), "isolated", payload())  # an unkeyed file under the name
    assert store(tmp_path, mac_key=one).load(KEY, TOKENS, "isolated", 2) is None


def _key_file(tmp_path, secret: bytes):
    path = tmp_path / f"key-{secret[:1].decode()}-{len(secret)}"
    path.write_bytes(secret)
    return str(path)


def test_a_store_key_file_that_is_missing_or_short_is_a_config_error(tmp_path):
    from graphchunk.config import GraphChunkConfig

    with pytest.raises(ConfigError, match="graphchunk.store_key_file=.* cannot be read"):
        read_store_key(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="holds 8 bytes; a store key needs at least 16"):
        read_store_key(_key_file(tmp_path, b"12345678"))
    with pytest.raises(ConfigError, match="store_key_file signs the persistent tier's files: set graphchunk.store_path"):
        GraphChunkConfig(store_key_file="/etc/key")
