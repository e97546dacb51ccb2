"""``RunnerKV``: the plans' ``KVDevice`` (``device.py``) over vLLM's model runner and its KV cache.

Prefill of pseudo-sequences (misses prefilled into pool blocks, blend tokens recomputed over a
request's own slots): vLLM's own ``CommonAttentionMetadata`` for sequences the scheduler does
not know, and the model run under a forward context of its own, built as vLLM's runner builds a
step's: no CUDA graph (``cudagraph_runtime_mode`` NONE: vLLM's graph wrappers run the model as
is), and the padding mask MoE routing reads (``VLLM_MOE_SKIP_PADDING``) as the runner's own
device buffer, none of it padding.

``num_layers`` runs only the first layers (CacheBlend's check), by narrowing the decoder's
``end_layer`` (``blend_support.first_layers``), the layer range vLLM's models already honour for pipeline parallelism. vLLM's
compiled model (``@support_torch_compile``) ignores it: the graph was traced once over every layer
and vLLM drops dynamo's guards, so it runs every layer whatever the range says. The check pass
therefore runs vLLM's plain forward (the forward context's ``skip_compiled``, vLLM's own bypass of
its compiled call): it traces and captures nothing and replays no graph. Full-depth prefills keep
the compiled graph.

The question-aware recompute policy's scoring pass (``context_attention``) runs the question
through vLLM's compiled graph (its plain forward for a policy with ``layers``, which runs only the
first layers), recording the query each attention layer hands its backend (``impl.forward``, which
vLLM calls from its attention custom op, outside the compiled graph); its attention to the context
is then computed from those queries and the keys in the cache, as the layer's softmax would (scale,
grouped heads). A 16-token question over 512 tokens: 74 ms, against the plain forward's 78 alone
(``perf/results/forward_cost.json``, one run on the 2-core CPU).

KV copies, key reads and the tier's block reads and writes go to ``KVCopier`` (``cache/kv_slots.py``),
which knows the backend's layout; rotated copies need blend's key rotation (``blend_support.py``).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from graphchunk.cache.kv_slots import KVCopier
from graphchunk.config import ConfigError
from graphchunk.device import PseudoSeq, slots_of
from graphchunk.engine.blend_support import BlendSupport, first_layers


WARM_UP_QUESTION = 16
"""Question tokens of the start-up warm-up's scoring pass (``RunnerKV.warm_up``)."""


class RunnerKV:
    def __init__(self, runner, copier: KVCopier, blend: BlendSupport, layers: list[torch.nn.Module]):
        """``runner``: vLLM's model runner (its model, attention groups, config, padding buffer);
        ``layers``: its attention layers in model order (the copier's layer order)."""
        self.runner, self.copier, self.blend, self.layers = runner, copier, blend, layers

    def prefill(self, seqs: list[PseudoSeq], num_layers: int | None = None) -> None:
        self._forward(seqs, num_layers, plain=num_layers is not None)

    def context_attention(self, seqs: list[PseudoSeq], num_layers: int | None = None) -> list[torch.Tensor]:
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        queries: dict[int, torch.Tensor] = {}
        with _recording_queries(layers, queries):
            self._forward(seqs, num_layers, plain=num_layers is not None)
        if len(queries) != len(layers):
            raise RuntimeError(f"question-aware recompute: {len(queries)} of {len(layers)} attention layers ran")
        bs = self.runner.cache_config.block_size
        scores, at = [], 0
        for seq in seqs:
            slots = slots_of(seq.block_ids, np.arange(len(seq.token_ids)), bs)
            keys = self.copier.read_layer_keys(slots, range(len(layers)))
            own = [queries[index][at:at + seq.num_new] for index in range(len(layers))]
            scores.append(self.sum_over_ranks(_attention_to_cached(own, keys, seq.num_cached, layers)))
            at += seq.num_new
        return scores

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

        return values if get_tensor_model_parallel_world_size() == 1 else tensor_model_parallel_all_reduce(values)

    def _forward(self, seqs: list[PseudoSeq], num_layers: int | None, plain: bool) -> None:
        """The model over ``seqs`` (its first ``num_layers`` layers when given); ``plain``: vLLM's
        plain forward, not its compiled graph."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        runner = self.runner
        bs = runner.cache_config.block_size
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
        to = lambda t: t.to(runner.device, non_blocking=True)  # noqa: E731
        common = CommonAttentionMetadata(
            query_start_loc=to(query_start), query_start_loc_cpu=query_start, seq_lens=to(seq_lens),
            num_reqs=len(seqs), num_actual_tokens=num_tokens, max_query_len=max(new_lens),
            max_seq_len=int(seq_lens.max()), block_table_tensor=to(block_table), slot_mapping=to(slot_mapping),
            causal=True, positions=to(positions), seq_lens_cpu_upper_bound=seq_lens)
        attn_metadata, slot_by_layer = {}, {}
        for group in runner.attn_groups[0]:
            metadata = group.build_metadata(common)
            for name in group.layer_names:
                attn_metadata[name], slot_by_layer[name] = metadata, common.slot_mapping
        with set_forward_context(attn_metadata, runner.vllm_config, num_tokens=num_tokens, slot_mapping=slot_by_layer,
                                 is_padding=padding_mask(runner, num_tokens), skip_compiled=plain), \
                first_layers(runner.model, num_layers):
            runner.model(input_ids=to(ids), positions=to(positions), intermediate_tensors=None, inputs_embeds=None)

    def warm_up(self, block_ids: list[int], num_tokens: int) -> None:
        """Runs blend's question-aware scoring pass once through vLLM's plain forward, a question of
        ``WARM_UP_QUESTION`` tokens over the rest of ``num_tokens`` cached in ``block_ids`` (pool
        blocks no entry holds yet; what it writes there is never read): the plain forward of a
        multi-token prefill runs nowhere else before a request needs it (a shallow question policy's
        scoring pass, CacheBlend's check pass, the question policy's fallback to it), and its first
        run costs that request 0.3-1.7 s on the 2-core CPU (a one-token pass does not warm it). The
        full-depth scoring pass runs vLLM's compiled graph, which vLLM's own warm-up has run: its
        first call costs what later ones do, with or without this."""
        context, tokens = num_tokens - WARM_UP_QUESTION, (0,) * num_tokens
        with torch.inference_mode():
            self.prefill([PseudoSeq(tokens[:context], np.arange(context), tuple(block_ids), 0)])
            self.context_attention([PseudoSeq(tokens, np.arange(len(tokens)), tuple(block_ids), context)],
                                   num_layers=len(self.layers))

    def request_blocks(self, req_id: str) -> list[int]:
        """The block ids vLLM's runner holds for request ``req_id`` (its one KV-cache group's)."""
        return self.runner.requests[req_id].block_ids[0]

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        self.copier.copy_blocks(src_blocks, dst_blocks)

    def copy_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray, key_temperature: float = 1.0) -> None:
        self.copier.copy_slots(src_slots, dst_slots, key_temperature)

    def copy_slots_rotated(self, src_slots: np.ndarray, dst_slots: np.ndarray, deltas: np.ndarray) -> None:
        self.copier.copy_slots_rotated(src_slots, dst_slots, deltas, self._rotation())

    def read_keys(self, layer: int, slots: np.ndarray) -> torch.Tensor:
        return self.copier.read_keys(layer, slots)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.copier.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.copier.write_blocks(block_ids, data)

    def read_slots(self, slots: np.ndarray) -> torch.Tensor:
        """On CUDA straight into pinned memory, which host memory keeps as it is (one device-to-host
        copy, not a copy to pageable memory and another to pinned)."""
        data = self.copier.read_slots(slots)
        if data.device.type != "cuda":
            return data.cpu()
        pinned = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        pinned.copy_(data)
        return pinned

    def write_slots(self, data: torch.Tensor, dst_slots: np.ndarray, key_temperature: float = 1.0,
                    deltas: np.ndarray | None = None) -> None:
        key = None
        if deltas is not None:
            rotation, moves = self._rotation(), torch.from_numpy(np.asarray(deltas, np.int64))
            key = lambda keys: rotation.rotate(keys, moves)  # noqa: E731
        elif key_temperature != 1:
            key = lambda keys: keys / key_temperature  # noqa: E731
        self.copier.write_slots(data, dst_slots, key)

    def _rotation(self):
        if self.blend.rotation is None:
            raise ConfigError(f"graphchunk blend mode is not available for this model: {self.blend.refusal}")
        return self.blend.rotation


@contextlib.contextmanager
def _recording_queries(layers: list[torch.nn.Module], queries: dict[int, torch.Tensor]):
    """Records into ``queries`` (layer index -> [tokens, heads, head_size]) the query each of
    ``layers`` hands its attention backend (``impl.forward``, after the rotary embedding), for the
    forwards run inside. vLLM calls the backend from its attention custom op, outside the compiled
    graph on every platform that registers attention as one opaque op (CPU, CUDA, ROCm, XPU), so
    this records from the compiled graph and from the plain forward alike."""
    index_of = {id(layer): index for index, layer in enumerate(layers)}
    impls = list({id(layer.impl): layer.impl for layer in layers}.values())

    def wrap(forward):
        def recording(layer, query, *args, **kwargs):
            index = index_of.get(id(layer))
            if index is not None:
                queries[index] = query.detach().clone()
            return forward(layer, query, *args, **kwargs)
        return recording

    own = [(impl, vars(impl).get("forward")) for impl in impls]  # an instance's own forward, kept
    for impl in impls:
        impl.forward = wrap(impl.forward)
    try:
        yield
    finally:
        for impl, forward in own:
            if forward is None:
                del impl.forward
            else:
                impl.forward = forward


_SCORE_ELEMENTS = 1 << 18
"""Most attention probabilities the scoring holds at once: layers are scored in groups under it
(one layer at a time past it), so that a group stays in the CPU's caches (measured on the 2-core
CPU: a 256-token question over 512 tokens 118 ms at this bound against 197 ms at 1 << 24; a
30-token one over 1000 tokens 21 against 24 ms)."""


def _attention_to_cached(queries: list[torch.Tensor], keys: list[torch.Tensor], num_cached: int,
                         layers: list[torch.nn.Module]) -> torch.Tensor:
    """Softmax attention of each layer's ``queries`` [n, heads, d] (the sequence's last n tokens)
    over its ``keys`` [num_cached + n, kv_heads, d], causal among the n, scaled by the layer's
    ``impl.scale``; the probabilities on the first ``num_cached`` keys summed over queries, heads
    and layers: [num_cached]. Query head h reads kv head h // (heads / kv_heads). Layers go in
    groups of at most ``_SCORE_ELEMENTS`` probabilities, each group one batched product per kv
    head, exponentiated in place."""
    n, heads, dim = queries[0].shape[0], layers[0].num_heads, layers[0].head_size
    length, kv_heads = keys[0].shape[0], keys[0].shape[1]
    grouped = heads // kv_heads
    device = keys[0].device
    later = torch.arange(length, device=device)[None, :] > num_cached + torch.arange(n, device=device)[:, None]
    total = torch.zeros(num_cached, device=device)
    step = max(1, _SCORE_ELEMENTS // max(1, heads * n * length))
    for lo in range(0, len(layers), step):
        part = range(lo, min(lo + step, len(layers)))
        q = torch.stack([queries[i].float().reshape(n, kv_heads, grouped, dim) * layers[i].impl.scale for i in part])
        q = q.permute(0, 2, 3, 1, 4).reshape(len(part) * kv_heads, grouped * n, dim)
        k = torch.stack([keys[i].float() for i in part]).permute(0, 2, 3, 1).reshape(len(part) * kv_heads, dim, length)
        logits = torch.bmm(q, k)
        logits.view(-1, grouped, n, length).masked_fill_(later, float("-inf"))
        logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        inverse = logits.sum(dim=-1, keepdim=True).reciprocal_()
        total += torch.bmm(inverse.transpose(1, 2), logits[..., :num_cached]).sum(dim=(0, 1))
    return total


def padding_mask(runner, num_tokens: int) -> torch.Tensor:
    """vLLM's padding mask over ``num_tokens`` tokens none of which is padding: the runner's
    persistent bool buffer on the device, filled as its steps fill it (``_prepare_padding_mask``);
    the step that follows fills it again for itself."""
    if num_tokens > runner.is_padding.numel():
        raise AssertionError(f"a pseudo-sequence prefill of {num_tokens} tokens exceeds the runner's "
                             f"{runner.is_padding.numel()} (max_num_batched_tokens)")
    return runner._prepare_padding_mask(num_tokens, num_tokens)
