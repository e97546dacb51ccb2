"""What vLLM's ``BlockPool`` does with a block it does not own (docs/architecture.md, "Documents
shared in place: what vLLM 0.32 refuses"): the refusals that section names, and the one piece
vLLM already has (a ``KVCacheBlock`` whose ``pool`` is another owner is handed back to that owner
when freed). Each assertion is one sentence of that section, checked against the installed vLLM,
so a release that changes any of them fails here and the section is read again.

A "pool block" here is a ``KVCacheBlock`` with an id past the scheduler's ``num_blocks``, as the
chunk pool's blocks are (``engine/kv_binding.py``).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

NUM_BLOCKS = 8
BLOCK = 4


def block_pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK)


class Owner:
    """A foreign owner of pool blocks: records what vLLM hands back."""

    def __init__(self):
        self.returned: list[int] = []

    def free_blocks(self, blocks):
        self.returned.extend(block.block_id for block in blocks)


def test_a_freed_block_it_does_not_own_joins_vllms_free_blocks():
    pool = block_pool()
    free = pool.get_num_free_blocks()
    foreign = KVCacheBlock(NUM_BLOCKS + 3, ref_cnt=1)
    pool.free_blocks([foreign])
    assert pool.get_num_free_blocks() == free + 1 == NUM_BLOCKS  # one more than it owns (less the null block)
    handed = pool.get_new_blocks(1)
    assert [b.block_id for b in handed] == [NUM_BLOCKS + 3]  # the next request would overwrite the entry


def test_a_block_of_another_owner_goes_back_to_that_owner_untouched():
    pool, owner = block_pool(), Owner()
    free = pool.get_num_free_blocks()
    own = pool.get_new_blocks(2)
    foreign = KVCacheBlock(NUM_BLOCKS + 1, ref_cnt=1, pool=owner)
    pool.free_blocks(reversed([own[0], foreign, own[1]]))  # as SingleTypeKVCacheManager.free orders them
    assert owner.returned == [NUM_BLOCKS + 1]
    assert foreign.ref_cnt == 1 and foreign.prev_free_block is None and foreign.next_free_block is None
    assert pool.get_num_free_blocks() == free


def test_a_full_block_is_hashed_into_the_prefix_cache_whoever_owns_it():
    pool, owner = block_pool(), Owner()
    foreign = KVCacheBlock(NUM_BLOCKS + 2, ref_cnt=1, pool=owner)
    request = SimpleNamespace(block_hashes=[b"h0"], request_id="r")
    pool.cache_full_blocks(request, [foreign], num_cached_blocks=0, num_full_blocks=1, block_size=BLOCK,
                           kv_cache_group_id=0)
    assert foreign.block_hash is not None
    assert pool.get_cached_block(b"h0", [0]) == [foreign]  # a later request's prefix hit


def test_a_hit_on_an_unreferenced_block_outside_the_free_queue_raises():
    pool = block_pool()
    foreign = KVCacheBlock(NUM_BLOCKS + 4)
    with pytest.raises(RuntimeError, match="invalid block"):
        pool.touch([foreign])


def test_evicting_a_block_id_past_the_pool_is_an_assertion():
    with pytest.raises(AssertionError, match="Invalid block_id"):
        block_pool().evict_blocks({NUM_BLOCKS + 5})
