"""The model runner as a ``KVDevice`` (``device.py``): pseudo-sequence forwards and KV copies.

A pseudo-sequence forward builds vLLM's own ``CommonAttentionMetadata`` for sequences the
scheduler does not know (misses prefilled into pool blocks, blend tokens recomputed over a
request's own slots) and runs the model under a forward context of its own, built as vLLM's runner
builds a step's: no CUDA graph (``cudagraph_runtime_mode`` NONE: vLLM's graph wrappers run the
model as is), and the padding mask MoE routing reads (``VLLM_MOE_SKIP_PADDING``) as the runner's own
device buffer, none of it padding.

``num_layers`` runs only the first layers (CacheBlend's check), by narrowing the decoder's
``end_layer`` — the layer range vLLM's models already honour for pipeline parallelism. vLLM's
compiled model (``@support_torch_compile``) ignores it: the graph was traced once over every layer
and vLLM drops dynamo's guards, so it runs every layer whatever the range says. The check pass
therefore runs vLLM's plain forward (the forward context's ``skip_compiled``, vLLM's own bypass of
its compiled call): it traces and captures nothing and replays no graph. Full-depth pseudo-sequence
forwards keep the compiled graph.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from graphchunk.cache.kv_slots import KVCopier
from graphchunk.config import ConfigError
from graphchunk.device import PseudoSeq, slots_of


class KVDeviceMixin:
    """``KVDevice`` methods of ``ChunkRunnerMixin``; ``gc_copier`` and ``gc_rotation`` are bound
    with the KV cache (``runner_bind._graphchunk_bind``)."""

    gc_copier: KVCopier

    def forward(self, seqs: list[PseudoSeq], num_layers: int | None = None) -> None:
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        bs = self.cache_config.block_size
        device = self.device
        new_lens = [s.num_new for s in seqs]
        seq_lens = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.int32)
        ids = torch.tensor(np.concatenate([np.asarray(s.token_ids[s.num_cached:]) for s in seqs]), dtype=torch.int32)
        positions = torch.from_numpy(np.concatenate([s.positions[s.num_cached:] for s in seqs]).astype(np.int64))
        block_table = torch.zeros(len(seqs), max(len(s.block_ids) for s in seqs), dtype=torch.int32)
        for i, s in enumerate(seqs):
            block_table[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
        slot_mapping = torch.from_numpy(np.concatenate(
            [slots_of(s.block_ids, np.arange(s.num_cached, len(s.token_ids)), bs) for s in seqs]))
        query_start = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        query_start[1:] = torch.cumsum(torch.tensor(new_lens), 0)
        num_tokens = int(query_start[-1])
        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        common = CommonAttentionMetadata(
            query_start_loc=to(query_start), query_start_loc_cpu=query_start, seq_lens=to(seq_lens),
            num_reqs=len(seqs), num_actual_tokens=num_tokens, max_query_len=max(new_lens),
            max_seq_len=int(seq_lens.max()), block_table_tensor=to(block_table), slot_mapping=to(slot_mapping),
            causal=True, positions=to(positions), seq_lens_cpu_upper_bound=seq_lens)
        attn_metadata, slot_by_layer = {}, {}
        for group in self.attn_groups[0]:
            metadata = group.build_metadata(common)
            for name in group.layer_names:
                attn_metadata[name], slot_by_layer[name] = metadata, common.slot_mapping
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=num_tokens, slot_mapping=slot_by_layer,
                                 is_padding=self._padding_mask(num_tokens), skip_compiled=num_layers is not None), \
                self._first_layers(num_layers):
            self.model(input_ids=to(ids), positions=to(positions), intermediate_tensors=None, inputs_embeds=None)

    def _padding_mask(self, num_tokens: int) -> torch.Tensor:
        """vLLM's padding mask over ``num_tokens`` tokens none of which is padding (a pseudo-sequence
        forward; a template's capture, ``runner_templates.py``): its runner's persistent bool buffer
        on the device, filled as its steps fill it (``_prepare_padding_mask``); the step that
        follows fills it again for itself."""
        if num_tokens > self.is_padding.numel():
            raise AssertionError(f"a pseudo-sequence forward of {num_tokens} tokens exceeds the runner's "
                                 f"{self.is_padding.numel()} (max_num_batched_tokens)")
        return self._prepare_padding_mask(num_tokens, num_tokens)

    @contextlib.contextmanager
    def _first_layers(self, num_layers: int | None):
        if num_layers is None:
            yield
            return
        decoder = decoder_stack(self.model)
        saved = decoder.end_layer
        decoder.end_layer = min(saved, decoder.start_layer + num_layers)
        try:
            yield
        finally:
            decoder.end_layer = saved

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        self.gc_copier.copy_blocks(src_blocks, dst_blocks)

    def copy_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        self.gc_copier.copy_slots(src_slots, dst_slots)

    def copy_slots_rotated(self, src_slots: np.ndarray, dst_slots: np.ndarray, deltas: np.ndarray) -> None:
        if self.gc_rotation is None:
            raise ConfigError(f"graphchunk blend mode is not available for this model: {self.gc_blend_refusal}")
        self.gc_copier.copy_slots_rotated(src_slots, dst_slots, deltas, self.gc_rotation)

    def read_keys(self, layer: int, slots: np.ndarray) -> torch.Tensor:
        return self.gc_copier.read_keys(layer, slots)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.gc_copier.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.gc_copier.write_blocks(block_ids, data)


def decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the decoder layers and the ``[start_layer, end_layer)`` range it runs."""
    for module in model.modules():
        if all(hasattr(module, name) for name in ("layers", "start_layer", "end_layer")):
            return module
    raise ConfigError(f"graphchunk CacheBlend needs a decoder with a layer range (start_layer/end_layer); "
                      f"{type(model).__name__} has none")
