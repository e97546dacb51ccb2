"""What the host-side plans (``cache/chunk_cache.py``, ``blend/recompute.py``) need from the device.

The model runner implements ``KVDevice`` (``engine/runner_device.py``); tests implement it with fakes.
A ``PseudoSeq`` is an extra forward outside vLLM's scheduler: a miss prefilled into pool blocks,
or a blend request's recomputed tokens over its own slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class PseudoSeq:
    """An extra forward: computes ``token_ids[num_cached:]`` at ``positions[num_cached:]``,
    attending causally to everything before, KV at logical index i in ``block_ids``' slot i."""

    token_ids: Sequence[int]
    positions: np.ndarray
    block_ids: Sequence[int]
    num_cached: int = 0

    @property
    def num_new(self) -> int:
        return len(self.token_ids) - self.num_cached


class KVDevice(Protocol):
    """What the plans need from the device (implemented by the model runner)."""

    def forward(self, seqs: list[PseudoSeq], num_layers: int | None = None) -> None:
        """Runs the pseudo-sequences through the model (its first ``num_layers`` layers only,
        when given), writing their KV."""

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None: ...

    def copy_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None: ...

    def copy_slots_rotated(self, src_slots: np.ndarray, dst_slots: np.ndarray, deltas: np.ndarray) -> None:
        """Copies KV moving each key ``deltas`` positions further (``blend/rope.py``); V unchanged."""

    def read_keys(self, layer: int, slots: np.ndarray) -> torch.Tensor:
        """K of ``slots`` at ``layer``: [n, kv_heads, head_size]."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks of every layer on the host (the persistent tier's payload)."""

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""


def split_forward_batches(seqs: list[PseudoSeq], budget: int) -> list[list[PseudoSeq]]:
    """Batches of at most ``budget`` new tokens; a longer sequence is cut into consecutive
    pieces, each a batch's last member so the next piece sees its KV."""
    batches, batch, used = [], [], 0
    for seq in seqs:
        cached = seq.num_cached
        while cached < len(seq.token_ids):
            take = min(len(seq.token_ids) - cached, budget - used)
            end = cached + take
            batch.append(PseudoSeq(seq.token_ids[:end], seq.positions[:end], seq.block_ids, cached))
            used += take
            cached = end
            if used == budget:
                batches.append(batch)
                batch, used = [], 0
    if batch:
        batches.append(batch)
    return batches


def slots_of(block_ids: Sequence[int], logical: np.ndarray, block_size: int) -> np.ndarray:
    """KV slots of logical token indices in a sequence whose blocks are ``block_ids``."""
    blocks = np.asarray(block_ids, np.int64)
    return blocks[logical // block_size] * block_size + logical % block_size
