"""What the plans' run (``cache/context_run.py``, ``blend/recompute.py``) needs from the device.

The engine implements ``KVDevice`` over vLLM's model runner (``engine/runner_kv.py``); tests
implement it with fakes.
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
    """What the plans need from the device."""

    def prefill(self, seqs: list[PseudoSeq], num_layers: int | None = None) -> None:
        """Prefills the pseudo-sequences' KV: runs their new tokens through the model (its first
        ``num_layers`` layers only, when given), writing KV into their slots."""

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None: ...

    def copy_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray, key_temperature: float = 1.0) -> None:
        """Copies KV from slot to slot, keys divided by ``key_temperature``; V unchanged."""

    def copy_slots_rotated(self, src_slots: np.ndarray, dst_slots: np.ndarray, deltas: np.ndarray) -> None:
        """Copies KV moving each key ``deltas`` positions further (``blend/rope.py``); V unchanged."""

    def read_keys(self, layer: int, slots: np.ndarray) -> torch.Tensor:
        """K of ``slots`` at ``layer``: [n, kv_heads, head_size] (this rank's heads)."""

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the tensor-parallel ranks (each holds its own heads' share), so
        that every rank selects the same tokens; itself without tensor parallelism."""

    def context_attention(self, seqs: list[PseudoSeq], num_layers: int | None = None) -> list[torch.Tensor]:
        """Runs the pseudo-sequences' new tokens through the model (its first ``num_layers`` layers
        only, when given; writing their KV there) and returns, per sequence, the attention they pay
        to each of its cached tokens: [num_cached] softmax probabilities summed over the new
        tokens, every head (of every rank) and every layer run."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks of every layer on the host (the persistent tier's payload)."""

    def read_slots(self, slots: np.ndarray) -> torch.Tensor:
        """Every layer's K and V of ``slots`` on the host, [layers, 2, n, heads, head_size] (host
        memory's payload)."""

    def write_slots(self, data: torch.Tensor, dst_slots: np.ndarray, key_temperature: float = 1.0,
                    deltas: np.ndarray | None = None) -> None:
        """Inverse of ``read_slots`` into ``dst_slots``, keys divided by ``key_temperature`` or, given
        ``deltas``, moved that many positions further, as ``copy_slots`` and ``copy_slots_rotated``."""

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


def consecutive_runs(*aligned: Sequence[int] | np.ndarray, block_size: int | None = None) -> list[tuple[int, ...]]:
    """Maximal runs over which each of the equally long index arrays ``aligned`` steps by exactly
    1 (and, given ``block_size``, none crosses a multiple of it): for each run, every array's first
    index, then the run's length. ``consecutive_runs([3, 4, 5, 8])`` is ``[(3, 3), (8, 1)]``."""
    arrays = [np.asarray(a, np.int64) for a in aligned]
    size = len(arrays[0])
    if any(len(a) != size for a in arrays):
        raise ValueError(f"consecutive_runs: arrays of lengths {[len(a) for a in arrays]}")
    if size == 0:
        return []
    cut = np.zeros(size - 1, bool)
    for a in arrays:
        cut |= np.diff(a) != 1
        if block_size is not None:
            cut |= a[1:] % block_size == 0
    starts = np.concatenate([[0], np.nonzero(cut)[0] + 1])
    lengths = np.diff(np.concatenate([starts, [size]]))
    return list(zip(*(a[starts].tolist() for a in arrays), lengths.tolist()))
