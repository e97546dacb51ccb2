"""Host memory below the pool: the scheduler's index (``host_index.HostIndex``: what is kept, what is
dropped, what nothing may drop) and the workers' payloads (``host_tier.HostTier``)."""
import pytest
import torch

from graphchunk.cache.host_index import HostIndex
from graphchunk.cache.host_tier import HostTier
from graphchunk.metrics import CacheMetrics

TOKENS = (5, 6, 7)


def key(i: int) -> bytes:
    return bytes([i]) * 16


def saved(index: HostIndex, i: int, num_tokens: int = 4, epoch: int | None = None):
    """An entry reserved by its job, which then ran (ready, released): droppable."""
    entry = index.reserve(key(i), TOKENS, num_tokens, i if epoch is None else epoch)
    assert entry is not None
    index.mark_ready(entry)
    index.release(entry)
    return entry


def test_room_comes_from_the_least_recently_used_entry_nothing_holds():
    index = HostIndex(10)
    for i in range(2):
        saved(index, i)
    assert index.lookup(key(0), TOKENS) is not None  # held, and now the most recent
    saved(index, 2)  # room for 4 of 10: entry 1 (nothing holds it, least recent) goes
    assert index.take_drops() == (1,) and not index.contains(key(1), TOKENS)
    assert index.reserve(key(3), TOKENS, 7, 3) is None  # entry 0 is held: 6 tokens at most
    assert index.take_drops() == () and index.used == 8
    assert index.reserve(key(3), TOKENS, 6, 3) is not None and index.take_drops() == (2,)
    index.check_invariants()


def test_an_entry_in_use_is_never_dropped_and_one_released_is_droppable_again():
    index = HostIndex(8)
    first = saved(index, 0)
    index.acquire(first)
    second = index.reserve(key(1), TOKENS, 4, 1)  # its job holds it
    assert second is not None and not index.contains(key(1), TOKENS)  # not ready: lookups miss it
    assert index.reserve(key(2), TOKENS, 1, 2) is None and index.take_drops() == ()
    index.release(first)
    assert index.reserve(key(2), TOKENS, 1, 2) is not None and index.take_drops() == (0,)
    index.check_invariants()


def test_a_lookup_matches_tokens_and_a_collision_replaces_an_unused_entry():
    index = HostIndex(100)
    saved(index, 0)
    assert index.lookup(key(0), TOKENS[:-1]) is None and index.lookup(key(1), TOKENS) is None
    other = index.reserve(key(0), (9, 9), 2, 7)  # same key, other tokens, the old one unused
    assert other is not None and index.take_drops() == (0,)
    held = index.reserve(key(0), (8,), 1, 8)  # the new one is its job's: it stays
    assert held is None


def test_a_payload_found_missing_is_forgotten_then_dropped_with_its_last_reference():
    index = HostIndex(100)
    entry = saved(index, 0)
    assert index.lookup(key(0), TOKENS) is entry
    index.forget([0])
    assert not index.contains(key(0), TOKENS) and index.take_drops() == ()
    index.release(entry)
    assert index.take_drops() == (0,) and index.used == 0
    index.forget([0, 5])  # gone or never there: nothing
    index.check_invariants()


def test_an_unready_entry_released_by_a_job_never_sent_is_dropped():
    index = HostIndex(100)
    entry = index.reserve(key(0), TOKENS, 3, 0)
    index.release(entry)
    assert index.take_drops() == (0,) and index.used == 0 and not index.contains(key(0), TOKENS)


def test_releasing_an_entry_not_in_use_is_an_error():
    index = HostIndex(100)
    with pytest.raises(RuntimeError, match="not in use"):
        index.release(saved(index, 2))


def test_the_workers_payloads_are_kept_and_dropped_as_told_within_their_budget():
    metrics = CacheMetrics()
    data = torch.ones(2, 2, 3, 1, 4, dtype=torch.bfloat16)
    size = data.numel() * 2
    host = HostTier(2 * size, metrics)
    assert host.put(1, data) and host.put(2, data * 2)
    assert not host.put(3, data) and host.get(3) is None  # past the budget: refused, not evicting
    assert torch.equal(host.get(2), data * 2) and metrics.tier_host_bytes == 2 * size
    host.drop([1, 9])
    assert host.get(1) is None and metrics.tier_host_bytes == size and metrics.tier_host_drops == 1


def test_a_rank_loads_from_host_memory_only_when_every_rank_holds_the_payload():
    others = [True]
    host = HostTier(1 << 20, all_ranks=lambda found: found and others[0])
    host.put(1, torch.zeros(1, 2, 1, 1, 1))
    assert host.get_on_all_ranks(1) is not None
    others[0] = False
    assert host.get_on_all_ranks(1) is None and host.get(1) is not None
