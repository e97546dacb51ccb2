"""Documents shared in place, as vLLM 0.32 would run them with the smallest change
docs/architecture.md names ("Documents shared in place: what vLLM 0.32 refuses"), applied here as a
test-only patch: nothing of it ships in graphchunk. Used by ``bench_in_place.py`` (what the change
would buy at the sizing benchmark's binding budget) and ``tests/test_in_place_sharing.py`` (vLLM's
accounting under it, randomized).

* ``in_place_patch()``: the change, on vLLM's own classes while the context lasts. A connector
  supplies, per request, blocks of another owner (a ``KVCacheBlock`` whose ``pool`` is that owner)
  at block indices of its external tokens (``SUPPLY``: where the proposed scheduler-side connector
  method would return them); the single-type manager counts none of them against vLLM's free blocks
  (``get_num_blocks_to_allocate``), places them at their indices and takes fresh blocks for the rest
  (``allocate_external_computed_blocks``), telling the owner it holds them; ``BlockPool`` hashes no
  block of another owner into its prefix cache (``cache_full_blocks``, ``cache_partial_block``).
  Frees need nothing: vLLM's ``BlockPool.free_blocks`` already hands a foreign block to its owner.
* ``Owner``: the chunk pool's stand-in: entries (a key, whole blocks with ids from vLLM's
  ``num_blocks`` on, as ``engine/kv_binding.py`` numbers the pool's), each held while a request vLLM
  holds names one of its blocks, the least recently used unheld one evicted for room.
* ``SimConnector``: a scheduler-side connector over an ``Owner``, in one of three kinds: 'vanilla'
  (no external tokens), 'copy' (graphchunk today: a request's documents are external tokens in its
  own fresh blocks, the pool keeps entries for later requests) and 'in_place' (the documents' blocks
  are the pool's, where the pool holds or can make room for them; else the request's own, as a copy).

Everything here is the scheduler's process: no model runs and no KV moves.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from unittest import mock

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

SUPPLY: dict[str, dict[int, KVCacheBlock]] = {}
"""Per request id: block index -> a block of another owner to place there (the connector's answer)."""


def _foreign(pool: BlockPool, block: KVCacheBlock) -> bool:
    return block.pool is not None and block.pool is not pool


@contextlib.contextmanager
def in_place_patch():
    """vLLM's KV cache manager with the change applied (the module docstring), for the context."""
    count, allocate = SingleTypeKVCacheManager.get_num_blocks_to_allocate, \
        SingleTypeKVCacheManager.allocate_external_computed_blocks
    cache_full, cache_partial = BlockPool.cache_full_blocks, BlockPool.cache_partial_block
    # The patch covers full attention only (what graphchunk admits): its manager inherits both methods.
    assert "get_num_blocks_to_allocate" not in vars(FullAttentionManager)
    assert "allocate_external_computed_blocks" not in vars(FullAttentionManager)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs):
        n = count(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs)
        if request_id in self.num_cached_block:  # running: its supplied blocks are in req_to_blocks
            return n
        first = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        last = -(-num_tokens // self.block_size)
        return max(0, n - sum(1 for i in SUPPLY.get(request_id, {}) if first <= i < last))

    def allocate_external_computed_blocks(self, request_id, num_local_computed_tokens, num_external_computed_tokens,
                                          record_for_zeroing=True):
        supply = SUPPLY.pop(request_id, None)
        if not supply:
            return allocate(self, request_id, num_local_computed_tokens, num_external_computed_tokens,
                            record_for_zeroing)
        req_blocks = self.req_to_blocks[request_id]
        end = -(-(num_local_computed_tokens + num_external_computed_tokens) // self.block_size)
        indices = range(len(req_blocks), end)
        fresh = self.block_pool.get_new_blocks(sum(1 for i in indices if i not in supply))
        taken = iter(fresh)
        req_blocks.extend(supply[i] if i in supply else next(taken) for i in indices)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(b.block_id for b in fresh)
        for i in indices:
            if i in supply:
                supply[i].pool.hold(supply[i])

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                          block_mask=None):
        new = blocks[num_cached_blocks:num_full_blocks]
        mask = [not _foreign(self, b) and (block_mask is None or block_mask[i]) for i, b in enumerate(new)]
        cache_full(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                   mask if block_mask is not None or not all(mask) else None)

    def cache_partial_block(self, request, block, *args, **kwargs):
        return None if _foreign(self, block) else cache_partial(self, request, block, *args, **kwargs)

    with mock.patch.multiple(SingleTypeKVCacheManager, get_num_blocks_to_allocate=get_num_blocks_to_allocate,
                             allocate_external_computed_blocks=allocate_external_computed_blocks), \
            mock.patch.multiple(BlockPool, cache_full_blocks=cache_full_blocks, cache_partial_block=cache_partial_block):
        try:
            yield
        finally:
            SUPPLY.clear()


@dataclass
class Entry:
    key: tuple
    blocks: list[KVCacheBlock]
    ready: bool = False
    """Computed by a request admitted with it (until then a request naming it computes it)."""


@dataclass(eq=False)
class Owner:
    """The chunk pool's stand-in: ``num_blocks`` blocks with ids from ``first_id`` on (hashable by
    identity: vLLM's ``free_blocks`` groups foreign blocks by owner)."""

    first_id: int
    num_blocks: int
    entries: "collections.OrderedDict[tuple, Entry]" = field(default_factory=collections.OrderedDict)
    refs: collections.Counter = field(default_factory=collections.Counter)
    """Per pool block id: how many of vLLM's requests name it (held, released by vLLM's frees)."""
    free: list[int] = field(default_factory=list)
    evictions: int = 0

    def __post_init__(self):
        self.free = list(range(self.first_id + self.num_blocks - 1, self.first_id - 1, -1))

    def held(self, entry: Entry) -> bool:
        return any(self.refs[b.block_id] for b in entry.blocks)

    def entry(self, key: tuple, num_blocks: int, keep=frozenset()) -> Entry | None:
        """The entry of ``key``: found (most recently used now), else made in free blocks or in those of
        the least recently used unheld entries but those of ``keep`` (the keys a request being
        admitted names already); None when that is not enough."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        victims = iter([e for e in self.entries.values() if not self.held(e) and e.key not in keep])
        while len(self.free) < num_blocks:
            victim = next(victims, None)
            if victim is None:
                return None
            del self.entries[victim.key]
            self.free += [b.block_id for b in victim.blocks]
            self.evictions += 1
        blocks = [KVCacheBlock(self.free.pop(), pool=self) for _ in range(num_blocks)]
        self.entries[key] = Entry(key, blocks)
        return self.entries[key]

    def hold(self, block: KVCacheBlock) -> None:
        self.refs[block.block_id] += 1

    def free_blocks(self, blocks) -> None:
        """vLLM hands back the blocks of ours a request named (it left, or was preempted)."""
        for block in blocks:
            assert self.refs[block.block_id] > 0, f"pool block {block.block_id} freed more often than placed"
            self.refs[block.block_id] -= 1


@dataclass(frozen=True)
class Doc:
    key: tuple
    start: int
    end: int


class SimConnector(KVConnectorBase_V1):
    """The scheduler's half of a connector (the module docstring); set ``kind``, ``owner`` and each
    request's documents (``docs[req_id]``) before scheduling."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.kind, self.owner = "vanilla", None
        self.docs: dict[str, list[Doc]] = {}
        self.block_size = vllm_config.cache_config.block_size
        self.admitted: set[str] = set()
        self.hits = self.misses = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        docs = self.docs.get(request.request_id)
        if self.kind == "vanilla" or not docs or num_computed_tokens >= docs[-1].end:
            return 0, False
        supply, named = {}, set()
        for doc in docs:
            entry = self.owner.entry(doc.key, -(-(doc.end - doc.start) // self.block_size), frozenset(named))
            if entry is not None and self.kind == "in_place" and doc.start >= num_computed_tokens:
                supply.update((doc.start // self.block_size + i, b) for i, b in enumerate(entry.blocks))
                named.add(doc.key)  # not evicted for this request's next documents
        SUPPLY[request.request_id] = supply  # what an earlier, refused allocation was offered is stale
        return docs[-1].end - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        if num_external_tokens and req_id not in self.admitted:
            self.admitted.add(req_id)
            for doc in self.docs[req_id]:
                entry = self.owner.entries.get(doc.key)
                if entry is not None and entry.ready:
                    self.hits += 1
                else:
                    self.misses += 1
                    if entry is not None:
                        entry.ready = True

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        SUPPLY.pop(request.request_id, None)
        return False, None

    # The worker's half: nothing runs here.
    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
