"""Independent references for DESIGN.md §2, on plain HF transformers.

Computations that share nothing with graphchunk's serving path except ``Layout``:
- isolated mode, the masked full forward: the whole prompt in one pass with an explicit 4D
  additive mask from ``Layout.attention_allowed`` and ``position_ids`` from ``Layout.positions``;
- isolated mode with a key temperature T: the same forward, the attention logits of question and
  generated tokens to chunk tokens multiplied by 1/T (``Layout.logit_scale``) inside an attention
  function of the oracle's own (eager attention plus that factor; without T, eager attention itself);
- isolated mode with APE's correction (``graphchunk.reference.ape``): the same forward, question and
  generated tokens' attention split into two softmaxes merged by their log-sum-exps (``ape=``);
- isolated mode, the incremental form: every chunk prefilled as its own ``sys ‖ chunk`` sequence
  with ordinary causal attention, the KV concatenated, and the question run over it
  (``incremental_last_logits``; ``isolated_cache`` + ``question_logprobs`` / ``question_generate``:
  the question, teacher-forced or greedy, over a context computed once, optionally with APE);
- blend mode's target: the plain causal forward (``causal_generate``, no mask, positions [0, N));
- the question-aware recompute policy's ranking (``question_attention``): HF's attention
  probabilities of the question over the naively reused context;
- blend mode with a given set of recomputed chunk tokens (``blend_generate``; none: naive reuse):
  sys prefilled causally, every chunk prefilled alone directly at the positions where it lands
  (no rotation involved: HF rotates at those positions itself), the recomputed tokens and the
  question run over that KV with an explicit mask, generated tokens at ordinary positions;
  with ``context_kv`` (``contextual_kv``: blend_entries 'context'), each chunk's KV instead taken
  from another prompt's causal forward and moved to where it lands by HF's own rotary embedding.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import transformers

from graphchunk.layout import Layout
from graphchunk.reference.ape import Ape, merged_attention
from graphchunk.reference.models import LOCAL

ATTENTION = "graphchunk_oracle"
"""The oracle's attention implementation: HF's eager attention, times a per-(query, key) factor
on the logits when a forward passes ``logit_scale``."""

# Per layer (keys, values), each [batch, kv_heads, tokens, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class OracleResult:
    tokens: list[int]
    last_logits: torch.Tensor  # [vocab] fp32: the logits the last generated token was chosen from


class Oracle:
    """HF model with eager attention, so a custom 4D float mask is added to the scores exactly."""

    def __init__(self, model_path: str | Path, dtype: torch.dtype = torch.float32):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=_register_attention(), **LOCAL
        ).eval()
        self.dtype = dtype
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._alone: tuple = (None, None)  # (prompt, its blend context KV): ``_alone_kv``'s last prompt

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int], layout: Layout, key_temperature: float = 1.0,
                       ape: Ape | None = None) -> torch.Tensor:
        """Logits [T, vocab] (fp32) of every prompt token under the isolated mask and positions."""
        _check_length(token_ids, layout)
        rows = slice(0, layout.num_tokens)
        out = self._forward(token_ids, layout.positions(), layout.attention_allowed(),
                            **_corrections(layout, key_temperature, ape, 0, rows))
        return out.logits[0].float()

    @torch.inference_mode()
    def generate(self, token_ids: list[int], layout: Layout, max_new_tokens: int,
                 ignore_eos: bool = False, key_temperature: float = 1.0, ape: Ape | None = None) -> OracleResult:
        """Greedy decoding; generated token n sits at position S+M+Q+n and attends to everything
        before it. Stops after an EOS token unless ``ignore_eos`` (as vLLM's SamplingParams).
        ``key_temperature``: question and generated tokens' logits to chunk tokens divided by it;
        ``ape``: their attention merged as APE does (``graphchunk.reference.ape``)."""
        _check_length(token_ids, layout)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        cache = transformers.DynamicCache(config=self.model.config)
        out = self._forward(token_ids, layout.positions(), layout.attention_allowed(), cache, keep=1,
                            **_corrections(layout, key_temperature, ape, 0, slice(0, layout.num_tokens)))
        tokens = []
        while True:
            last_logits = out.logits[0, -1].float()
            tokens.append(int(last_logits.argmax()))
            if len(tokens) == max_new_tokens or (tokens[-1] in self.eos_token_ids and not ignore_eos):
                return OracleResult(tokens, last_logits)
            num_generated = len(tokens)  # the newest token is fed back; it is decode token num_generated
            last = slice(layout.num_tokens + num_generated - 1, layout.num_tokens + num_generated)
            out = self._forward(tokens[-1:], layout.positions(num_generated)[last],
                                layout.attention_allowed(num_generated)[last], cache,
                                **_corrections(layout, key_temperature, ape, num_generated, last))

    @torch.inference_mode()
    def isolated_cache(self, token_ids: list[int], layout: Layout) -> transformers.DynamicCache:
        """The isolated context's KV, the incremental form: sys once, then every chunk's part of its
        own causal ``sys ‖ chunk`` prefill (what a chunk cache stores and reuses)."""
        _check_length(token_ids, layout)
        sys_ids = token_ids[:layout.sys_len]
        segments = [sys_ids + token_ids[start:start + n]
                    for start, n in zip(layout.chunk_starts(), layout.chunk_lens)] or [sys_ids]
        segment_kvs = [self._causal_kv(segment) for segment in segments if segment]
        return transformers.DynamicCache(
            _concat_context_kv(segment_kvs, layout.sys_len) if segment_kvs else None, config=self.model.config)

    @torch.inference_mode()
    def question_logprobs(self, cache: transformers.DynamicCache, token_ids: list[int], layout: Layout,
                          forced: list[int], apes: Sequence[Ape | None] = (None,)) -> torch.Tensor:
        """Log-softmax [len(apes), len(forced), vocab] at each step of a teacher-forced continuation:
        the question and ``forced[:-1]`` in one forward over an ``isolated_cache`` (not changed), one
        batch row per APE setting (None: plain isolated mode)."""
        g = len(forced) - 1
        rows = slice(layout.context_len, layout.num_tokens + g)
        width = layout.num_tokens + g
        batch = _batched(cache, len(apes), width, self.model.config)
        out = self._forward(token_ids[layout.context_len:] + forced[:-1], layout.positions(g)[rows],
                            _padded(layout.attention_allowed(g)[rows], width), batch, keep=len(forced),
                            batch=len(apes), **_ape_rows(layout, apes, g, rows, width))
        return out.logits.float().log_softmax(-1)

    @torch.inference_mode()
    def question_generate(self, cache: transformers.DynamicCache, token_ids: list[int], layout: Layout,
                          max_new_tokens: int, apes: Sequence[Ape | None] = (None,)) -> list[list[int]]:
        """Greedy tokens of the question over an ``isolated_cache`` (not changed), one list per APE
        setting (None: plain isolated mode), each ending at its first EOS."""
        rows = slice(layout.context_len, layout.num_tokens)
        width = layout.num_tokens + max_new_tokens
        batch = _batched(cache, len(apes), width, self.model.config)
        new, tokens = [token_ids[layout.context_len:]] * len(apes), []
        while len(tokens) < max_new_tokens and not (tokens and all(self._ended(t) for t in zip(*tokens))):
            g = len(tokens)
            out = self._forward(new, layout.positions(g)[rows], _padded(layout.attention_allowed(g)[rows], width),
                                batch, keep=1, batch=len(apes), **_ape_rows(layout, apes, g, rows, width))
            tokens.append(out.logits[:, -1].argmax(-1).tolist())
            new, rows = [[t] for t in tokens[-1]], slice(layout.num_tokens + g, layout.num_tokens + g + 1)
        per_setting = [list(t) for t in zip(*tokens)]
        return [t[:next((j + 1 for j, x in enumerate(t) if x in self.eos_token_ids), len(t))] for t in per_setting]

    def _ended(self, tokens) -> bool:
        return any(t in self.eos_token_ids for t in tokens)

    @torch.inference_mode()
    def incremental_last_logits(self, token_ids: list[int], layout: Layout) -> torch.Tensor:
        """Last prompt token's logits [vocab] (fp32) computed the way a chunk cache would."""
        cache = self.isolated_cache(token_ids, layout)
        question = slice(layout.context_len, layout.num_tokens)
        # No mask: HF's own causal mask over cache + question is "everything before".
        out = self._forward(token_ids[question], layout.positions()[question], None, cache, keep=1)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def causal_generate(self, token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens and each one's log-softmax over the vocabulary, under HF's plain causal
        forward (what vanilla vLLM computes); EOS does not stop it."""
        cache = transformers.DynamicCache(config=self.model.config)
        out = self._forward(token_ids, np.arange(len(token_ids)), None, cache, keep=1)
        return self._greedy(out, cache, len(token_ids), max_new_tokens)

    @torch.inference_mode()
    def blend_generate(self, token_ids: list[int], layout: Layout, recomputed: Sequence[int],
                       max_new_tokens: int, stop_at_eos: bool = False,
                       context_kv: list[LayerKV] | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Blend mode with the chunk tokens ``recomputed`` given fresh KV (empty: naive reuse).

        Every other chunk token's KV is computed alone at the positions where its chunk lands
        (HF rotates at those positions itself), sys causally at [0, S). The recomputed tokens and
        the question then run as one forward over that cache with an explicit mask "every token at
        a smaller or equal position": per layer each of them writes its fresh KV and attends to the
        reused KV before it and to the fresh KV of the recomputed tokens before it — what
        recomputing them under full causal attention means. Generated tokens follow at ordinary
        positions. ``context_kv``: the context's reused KV (default: chunks alone, ``_alone_kv``)."""
        cache, new, allowed = self._blend_run(token_ids, layout, recomputed, 0, context_kv)
        out = self._forward([token_ids[t] for t in new], new, allowed, cache, keep=1)
        return self._greedy(out, cache, layout.num_tokens, max_new_tokens, stop_at_eos)

    @torch.inference_mode()
    def blend_logprobs(self, token_ids: list[int], layout: Layout, recomputed: Sequence[int],
                       forced: list[int], context_kv: list[LayerKV] | None = None) -> torch.Tensor:
        """``blend_generate``'s model teacher-forced on ``forced``: log-softmax [len(forced), vocab]."""
        cache, new, allowed = self._blend_run(token_ids, layout, recomputed, len(forced) - 1, context_kv)
        ids = [token_ids[t] for t in new[:len(new) - len(forced) + 1]] + forced[:-1]
        out = self._forward(ids, new, allowed, cache, keep=len(forced))
        return out.logits[0].float().log_softmax(-1)

    def _blend_run(self, token_ids: list[int], layout: Layout, recomputed: Sequence[int], num_generated: int,
                   context_kv: list[LayerKV] | None = None):
        """(cache, logical indices = positions of the tokens to run, their mask): the recomputed chunk
        tokens, the question and ``num_generated`` generated tokens over the reused KV, each seeing
        every token at a smaller or equal position."""
        cache, kept, fresh = self._blend_cache(token_ids, layout, recomputed, context_kv)
        new = np.array(fresh + list(range(layout.context_len, layout.num_tokens + num_generated)), dtype=np.int64)
        keys = np.concatenate([np.array(kept, dtype=np.int64), new])
        return cache, new, keys[None, :] <= new[:, None]

    @torch.inference_mode()
    def question_attention(self, token_ids: list[int], layout: Layout, num_layers: int | None = None,
                           context_kv: list[LayerKV] | None = None) -> np.ndarray:
        """The question's attention over the naively reused context (blend, nothing recomputed):
        HF's own softmax probabilities, summed over the question's tokens, every head and every
        layer (the first ``num_layers`` only, when given), per context token [context_len] (what
        the ``question`` recompute policy ranks by)."""
        cache, kept, _ = self._blend_cache(token_ids, layout, (), context_kv)
        question = np.arange(layout.context_len, layout.num_tokens)
        keys = np.concatenate([np.array(kept, dtype=np.int64), question])
        out = self._forward(token_ids[layout.context_len:], question, keys[None, :] <= question[:, None], cache,
                            output_attentions=True, keep=1)
        total = sum(layer[0].float().sum(dim=(0, 1)) for layer in out.attentions[:num_layers])  # [keys]
        return total[: layout.context_len].numpy().astype(np.float64)

    def _blend_cache(self, token_ids: list[int], layout: Layout, recomputed: Sequence[int],
                     context_kv: list[LayerKV] | None = None):
        """(cache, its tokens' logical indices, the recomputed tokens sorted): sys causal, every chunk
        alone at the positions where it lands, without the ``recomputed`` tokens."""
        _check_length(token_ids, layout)
        fresh_set = {int(t) for t in recomputed}
        fresh = sorted(fresh_set)
        if any(not layout.sys_len <= t < layout.context_len for t in fresh):
            raise ValueError("only chunk tokens can be recomputed")
        alone = self._alone_kv(token_ids, layout) if context_kv is None else context_kv  # [context_len] per layer
        kept = [t for t in range(layout.context_len) if t not in fresh_set]
        index = torch.tensor(kept, dtype=torch.long)
        layers = [tuple(x[:, :, index] for x in layer) for layer in alone]
        return transformers.DynamicCache(layers, config=self.model.config), kept, fresh

    def _alone_kv(self, token_ids: list[int], layout: Layout) -> list[LayerKV]:
        """The context's KV as blend reuses it (sys causal at [0, S), every chunk computed alone at
        the positions where it lands), per layer; the last prompt's is kept, so the settings of one
        prompt compute it once."""
        key = (tuple(token_ids), layout)
        if self._alone[0] != key:
            self._alone = key, _cat_parts(self._sys_part(token_ids, layout) + [
                self._causal_kv(token_ids[start:start + n], first_position=start)
                for start, n in zip(layout.chunk_starts(), layout.chunk_lens)])
        return self._alone[1]

    @torch.inference_mode()
    def prefixed_kv(self, token_ids: list[int], layout: Layout, prefix: Sequence[int]) -> list[LayerKV]:
        """The context's KV as blend would reuse chunks computed after a fixed ``prefix`` (the same
        tokens before every chunk, DESIGN.md §2's "fixed model-level prefix"): sys causal at [0, S);
        each chunk's KV from the causal forward of ``prefix ‖ chunk``, the prefix's KV dropped and the
        chunk's keys moved from [m, m + L) to where the chunk lands by HF's own rotary embedding."""
        m, parts = len(prefix), self._sys_part(token_ids, layout)
        for begin, n in zip(layout.chunk_starts(), layout.chunk_lens):
            kv = self._causal_kv(list(prefix) + token_ids[begin:begin + n])
            parts.append([(self._moved(k[:, :, m:], begin - m), v[:, :, m:]) for k, v in kv])
        return _cat_parts(parts)

    @torch.inference_mode()
    def contextual_kv(self, token_ids: list[int], layout: Layout, source_ids: list[int],
                      source_layout: Layout) -> list[LayerKV]:
        """The context's KV as blend reuses entries taken from another prompt's full prefill
        (blend_entries 'context'): sys causal at [0, S); each chunk's KV from the causal forward of
        ``source_ids`` (which holds the same chunk), its keys moved from where it sat there to where
        it lands here by HF's own rotary embedding (RoPE rotations compose); values unmoved."""
        source = self._causal_kv(source_ids)
        where = {tuple(source_ids[b:b + n]): b for b, n in zip(source_layout.chunk_starts(), source_layout.chunk_lens)}
        parts = self._sys_part(token_ids, layout)
        for begin, n in zip(layout.chunk_starts(), layout.chunk_lens):
            at = where[tuple(token_ids[begin:begin + n])]
            parts.append([(self._moved(k[:, :, at:at + n], begin - at), v[:, :, at:at + n]) for k, v in source])
        return _cat_parts(parts)

    def _sys_part(self, token_ids: list[int], layout: Layout) -> list[list[LayerKV]]:
        """[the sys prompt's causal KV] (empty without one): the first part of a blend context."""
        return [self._causal_kv(token_ids[:layout.sys_len])] if layout.sys_len else []

    def _moved(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` [1, heads, n, dim] rotated by ``delta`` positions with the model's own rotary
        embedding and its module's ``apply_rotary_pos_emb``."""
        cos, sin = self.model.model.rotary_emb(keys, torch.full((1, keys.shape[2]), delta))
        module = importlib.import_module(type(self.model).__module__)
        return module.apply_rotary_pos_emb(keys, keys, cos, sin)[1]

    def naive_reuse_generate(self, token_ids: list[int], layout: Layout,
                             max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Blend mode with nothing recomputed: each chunk's KV computed alone at its own ordinary
        positions [P, P + L); sys causal at [0, S); question and generated tokens over all of it."""
        return self.blend_generate(token_ids, layout, (), max_new_tokens)

    def _greedy(self, out, cache, next_position: int, max_new_tokens: int,
                stop_at_eos: bool = False) -> tuple[list[int], list[torch.Tensor]]:
        tokens, logprobs = [], []
        while True:
            logprobs.append(out.logits[0, -1].float().log_softmax(-1))
            tokens.append(int(logprobs[-1].argmax()))
            if len(tokens) == max_new_tokens or (stop_at_eos and tokens[-1] in self.eos_token_ids):
                return tokens, logprobs
            out = self._forward(tokens[-1:], np.array([next_position]), None, cache)
            next_position += 1

    def _causal_kv(self, token_ids: list[int], first_position: int = 0) -> list[LayerKV]:
        """KV of an ordinary causal prefill at positions [first_position, first_position + len)."""
        cache = transformers.DynamicCache(config=self.model.config)
        self._forward(token_ids, np.arange(first_position, first_position + len(token_ids)), None, cache, keep=1)
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _forward(self, token_ids: list[int], positions: np.ndarray, allowed: np.ndarray | None,
                 cache: transformers.DynamicCache | None = None, scale: np.ndarray | None = None,
                 output_attentions: bool = False, ape: tuple | None = None, keep: int = 0, batch: int = 1):
        """One HF forward; ``keep``: logits of the last ``keep`` tokens only (0: every token's; the
        vocabulary projection of a whole prompt costs more than the rest of a small model);
        ``batch``: the same tokens in that many rows (or ``token_ids`` a list of rows), every row at
        the same positions under the same mask."""
        extra = {"output_attentions": True} if output_attentions else {}
        if scale is not None:
            extra["logit_scale"] = torch.from_numpy(scale).to(self.dtype)[None, None]
        if ape is not None:
            tempered, temperature, s = ape
            tempered = torch.from_numpy(tempered)
            extra["ape"] = (tempered[None, None] if tempered.ndim == 2 else tempered[:, None], temperature, s)
        ids = token_ids if token_ids and isinstance(token_ids[0], list) else [token_ids] * batch
        return self.model(
            input_ids=torch.tensor(ids),
            position_ids=torch.from_numpy(positions)[None],
            attention_mask=None if allowed is None else self._additive_mask(allowed),
            past_key_values=cache,
            use_cache=cache is not None,
            logits_to_keep=keep,
            **extra,
        )

    def _additive_mask(self, allowed: np.ndarray) -> torch.Tensor:
        """[1, 1, queries, keys]: 0 where allowed, dtype-min elsewhere (eager adds it to the scores)."""
        blocked = torch.finfo(self.dtype).min
        return torch.where(torch.from_numpy(allowed), 0.0, blocked).to(self.dtype)[None, None]


def _cat_parts(parts: list[list[LayerKV]]) -> list[LayerKV]:
    """Per layer, the (keys, values) of ``parts`` (each a list of per-layer KV) concatenated along tokens."""
    return [tuple(torch.cat([part[layer][which] for part in parts], dim=2) for which in (0, 1))
            for layer in range(len(parts[0]))]


def _concat_context_kv(segment_kvs: list[list[LayerKV]], sys_len: int) -> list[LayerKV]:
    """sys KV once (identical in every segment), then each chunk's own part, per layer."""
    def cat(layer: int, which: int) -> torch.Tensor:
        parts = [segment_kvs[0][layer][which][:, :, :sys_len]]
        parts += [kv[layer][which][:, :, sys_len:] for kv in segment_kvs]
        return torch.cat(parts, dim=2)

    return [(cat(layer, 0), cat(layer, 1)) for layer in range(len(segment_kvs[0]))]


def _corrections(layout: Layout, key_temperature: float, ape: Ape | None, num_generated: int, rows: slice) -> dict:
    """``_forward``'s arguments for the query ``rows`` of a forward (all keys so far): the logit
    factors of a key temperature (none at 1: plain eager attention) and APE's tempered part."""
    if key_temperature != 1 and ape is not None:
        raise ValueError("a key temperature and APE's correction are two corrections of one thing; give one")
    out = {}
    if key_temperature != 1:
        out["scale"] = layout.logit_scale(key_temperature, num_generated)[rows]
    if ape is not None:
        out["ape"] = (ape.tempered(layout, num_generated)[rows], ape.temperature, ape.scale)
    return out


def _ape_rows(layout: Layout, apes: Sequence[Ape | None], num_generated: int, rows: slice, width: int) -> dict:
    """``_forward``'s ``ape`` for one batch row per setting (None: T = S = 1 with nothing tempered,
    i.e. plain attention), keys padded to ``width``; {} when no row has APE."""
    if all(ape is None for ape in apes):
        return {}
    nothing = np.zeros_like(layout.document_keys(num_generated)[rows])
    tempered = np.stack([_padded(nothing if ape is None else ape.tempered(layout, num_generated)[rows], width)
                         for ape in apes])
    column = lambda values: torch.tensor(values, dtype=torch.float32)[:, None, None, None]  # noqa: E731
    return {"ape": (tempered, column([1.0 if a is None else a.temperature for a in apes]),
                    column([1.0 if a is None else a.scale for a in apes]))}


def _batched(cache: transformers.DynamicCache, batch: int, width: int, config) -> transformers.StaticCache:
    """A new cache of ``width`` tokens holding ``cache``'s context ``batch`` times (``cache`` itself is
    not changed). Static: a decode step writes its token in place (a dynamic cache of 14 rows copies
    the whole context at every step, 7x a step's own cost); attention then reads all ``width`` keys,
    the ones not yet written masked (``_padded``)."""
    static = transformers.StaticCache(config=config, max_cache_len=width)
    for layer, context in zip(static.layers, cache.layers):
        layer.update(context.keys.expand(batch, -1, -1, -1), context.values.expand(batch, -1, -1, -1))
    return static


def _padded(keys: np.ndarray, width: int) -> np.ndarray:
    """A boolean [..., keys] matrix with False columns up to ``width`` keys."""
    return np.pad(keys, [(0, 0)] * (keys.ndim - 1) + [(0, width - keys.shape[-1])])


def _scaled_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, logit_scale=None,
                            ape=None, **kwargs):
    """The model's own eager attention; with ``logit_scale`` [1, 1, queries, keys], plain
    dot-product attention whose logits q.k * scaling are multiplied by it before the mask is added
    and the softmax taken; with ``ape`` (tempered [1, 1, queries, keys], T, S), APE's merge of the
    tempered part and the rest (``graphchunk.reference.ape.merged_attention``)."""
    if logit_scale is None and ape is None:
        eager = importlib.import_module(type(module).__module__).eager_attention_forward
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if getattr(module.config, "attn_logit_softcapping", None) or kwargs.get("sliding_window"):
        raise NotImplementedError("the oracle's key temperature and APE cover plain dot-product attention only")
    groups = module.num_key_value_groups
    if ape is not None:  # query heads grouped per KV head: [batch, kv_heads, groups, queries, ...]
        b, h, q, d = query.shape
        grouped = query.view(b, h // groups, groups, q, d)
        logits = torch.matmul(grouped, key[:, :, None].transpose(3, 4)) * scaling
        allowed = attention_mask == 0 if attention_mask is not None else torch.ones_like(ape[0])
        t, s = (x[..., None] if torch.is_tensor(x) else x for x in ape[1:])  # per batch row, or one float
        out = merged_attention(logits, value[:, :, None], allowed[:, :, None], ape[0][:, :, None], t, s)
        return out.view(b, h, q, d).transpose(1, 2).contiguous(), None
    keys, values = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    weights = torch.matmul(query, keys.transpose(2, 3)) * scaling * logit_scale
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


def _register_attention() -> str:
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    transformers.AttentionInterface.register(ATTENTION, _scaled_eager_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)
    return ATTENTION


def _check_length(token_ids: list[int], layout: Layout) -> None:
    if len(token_ids) != layout.num_tokens:
        raise ValueError(f"{len(token_ids)} token ids but the layout has {layout.num_tokens} tokens")
