"""The chunk pool's entries on vLLM's KV-event stream: ``PoolEvents``, the pool's listener where
vLLM schedules (``context_scheduler.py``), turns each entry stored (ready) or removed into vLLM's
``BlockStored`` / ``BlockRemoved`` (medium ``graphchunk``), which the connector hands vLLM
(``take_events``) for its event publisher (``--kv-events-config``) and KV-aware routers.
"""
from __future__ import annotations

import xxhash

EVENT_MEDIUM = "graphchunk"
"""The medium of graphchunk's KV events: position-independent chunk entries, not prefix blocks."""


def event_blocks(key: bytes, tokens, block_size: int) -> list[bytes]:
    """An entry's block hashes on the KV-event stream: the entry as a chain of ``block_size``-token
    blocks from its first token (a partial last block included), block ``i`` hashed from the
    entry's content key and ``i``. A router that indexes the events' tokens by prefix in blocks of
    vLLM's size (vllm-router's ``kv_aware``) then credits an isolated entry (sys prompt and chunk)
    to a prompt that starts with that sys prompt and chunk, and a blend entry (the chunk alone) to
    one that starts with the chunk: in both cases KV of that prompt's prefix this server holds."""
    count = max(1, -(-len(tokens) // block_size))
    return [key] + [xxhash.xxh3_128_digest(key + i.to_bytes(4, "big")) for i in range(1, count)]


class PoolEvents:
    """The pool's listener (``ChunkPool.listener``): its entries' events since the last ``take``."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list = []

    def stored(self, entry) -> None:
        from vllm.distributed.kv_events import BlockStored

        self._events.append(BlockStored(block_hashes=event_blocks(entry.key, entry.tokens, self.block_size),
                                        parent_block_hash=None, token_ids=list(entry.tokens),
                                        block_size=self.block_size, lora_id=None, medium=EVENT_MEDIUM,
                                        lora_name=None))

    def removed(self, entry) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        self._events.append(BlockRemoved(block_hashes=event_blocks(entry.key, entry.tokens, self.block_size),
                                         medium=EVENT_MEDIUM))

    def take(self) -> list:
        events, self._events = self._events, []
        return events
