"""Moving cached K to another position: ``K' = R(P) K`` for keys computed at position 0 + i.

Blend mode (DESIGN.md §2) computes a chunk's KV alone at positions [0, L) and reuses it at
offset P. RoPE rotates each key by its position, and for a fixed set of frequencies rotations
compose, ``R(a) R(b) = R(a + b)``, so K computed at i and rotated by R(P) is K computed at P + i;
V never moves. This holds for vLLM's default, linear (one factor), llama3, static-NTK and YaRN
rotary embeddings; for YaRN the cos/sin cache carries the attention scale ``mscale``, which is not
part of a rotation and is divided out. Embeddings whose frequencies are not fixed (dynamic NTK,
Phi-3 LongRoPE switching at a length, M-RoPE's multi-axis positions, dual-chunk attention) or
models without RoPE are refused: blend mode never approximates a position move silently.

The rotation reads the module's own float32 cos/sin rows (``_compute_cos_sin_cache``, before
vLLM casts them to the model dtype), so a chunk computed at 0 and rotated by P gets the very
angles vLLM would have used at P. It is vectorised over every layer, token, head and dimension.
"""
from __future__ import annotations

import torch

from graphchunk.config import ConfigError

_FIXED = ("RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding",
          "NTKScalingRotaryEmbedding", "YaRNScalingRotaryEmbedding")
"""vLLM rotary classes (by exact class name) whose angles are position x fixed frequencies."""
_WHY_NOT = {
    "DynamicNTKScalingRotaryEmbedding": "dynamic NTK scaling changes its frequencies with the sequence length",
    "DynamicNTKAlphaRotaryEmbedding": "dynamic NTK scaling changes its frequencies with the sequence length",
    "Phi3LongRoPEScaledRotaryEmbedding": "LongRoPE switches frequencies at a length",
    "DualChunkRotaryEmbedding": "dual-chunk attention positions are not one rotation per token",
}


class KeyRotation:
    """``rotate(k, deltas)``: keys [..., n, heads, head_size] rotated by ``deltas`` [n] positions."""

    def __init__(self, cos_sin: torch.Tensor, rotary_dim: int, is_neox_style: bool):
        self.cos_sin = cos_sin.float()  # [positions, rotary_dim]: cos then sin halves
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style

    @property
    def max_delta(self) -> int:
        return self.cos_sin.shape[0] - 1

    @classmethod
    def from_module(cls, rope: torch.nn.Module) -> "KeyRotation":
        name = type(rope).__name__
        if name in _WHY_NOT:
            raise ConfigError(f"graphchunk blend mode cannot move cached keys for this model: {_WHY_NOT[name]} "
                              f"({name}); use mode 'isolated'")
        if "MRotary" in name or name not in _FIXED:
            raise ConfigError(f"graphchunk blend mode cannot move cached keys for this model: its rotary embedding "
                              f"{name} is not known to be a fixed rotation per position; use mode 'isolated'")
        if len(getattr(rope, "scaling_factors", [1.0])) != 1:
            raise ConfigError(f"graphchunk blend mode: {name} with several scaling factors "
                              f"{rope.scaling_factors} is not one rotation per position; use mode 'isolated'")
        cos_sin = rope._compute_cos_sin_cache().float()
        cos_sin = cos_sin / float(getattr(rope, "mscale", 1.0))  # YaRN's attention scale is not a rotation
        return cls(cos_sin, rope.rotary_dim, rope.is_neox_style)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "KeyRotation":
        """The rotation of the one rotary embedding every attention layer of ``model`` uses."""
        ropes = {id(m): m for m in model.modules() if _is_rotary(m)}
        if not ropes:
            raise ConfigError("graphchunk blend mode needs a model with rotary position embeddings (RoPE); "
                              "this model has none; use mode 'isolated'")
        kinds = {type(m).__name__ for m in ropes.values()}
        rotations = [cls.from_module(m) for m in ropes.values()]
        first = rotations[0]
        if len(kinds) > 1 or any(r.rotary_dim != first.rotary_dim or r.is_neox_style != first.is_neox_style
                                 or not torch.equal(r.cos_sin, first.cos_sin) for r in rotations[1:]):
            raise ConfigError(f"graphchunk blend mode needs one rotary embedding shared by all layers; this model "
                              f"has several ({sorted(kinds)}); use mode 'isolated'")
        return first

    def rotate(self, k: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """``k`` [..., n, heads, head_size] rotated by ``deltas`` [n] (int64) positions, back towards
        0 where negative (a chunk's keys taken from where a full prefill computed them); same dtype."""
        if deltas.numel() and int(deltas.abs().max()) > self.max_delta:
            raise ValueError(f"cannot rotate by {int(deltas.abs().max())} positions: the rotary cache has "
                             f"{self.max_delta + 1}")
        half = self.rotary_dim // 2
        deltas = deltas.to(k.device)
        table = self.cos_sin.to(k.device)[deltas.abs()]  # [n, rotary_dim]
        # R(-d) = R(d)^-1: the same cosine, the sine negated (indexing the table by -d would read its end).
        cos, sin = table[:, None, :half], table[:, None, half:] * deltas.sign()[:, None, None]  # [n, 1, half]
        x = k.to(torch.float32, copy=True)  # rotated in place below, in float32 whatever k's dtype
        rot = x[..., : self.rotary_dim]
        if self.is_neox_style:
            x1, x2 = rot[..., :half], rot[..., half:]
        else:  # GPT-J style: interleaved pairs
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        first = x1.clone()
        x1.mul_(cos).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
        x2.mul_(cos).addcmul_(first, sin)  # x2 cos + x1 sin
        return x.to(k.dtype)


_HF_FIXED = ("default", "linear", "llama3", "yarn")
"""HF ``rope_type``s whose vLLM embedding is one of ``_FIXED``."""


def hf_rope_refusal(hf_config) -> str | None:
    """Why blend mode cannot move this model's keys, judged from its HF config before any weights
    load (the API process refuses blend requests with it, the worker a blend default at start-up);
    None when it can. The worker confirms on the loaded model (``KeyRotation.from_model``)."""
    config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not params and getattr(config, "rope_theta", None) is None:
        return "the model has no rotary position embedding (RoPE) in its config"
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma-3's local/global)
        if len({repr(sorted(v.items())) for v in params.values()}) > 1:
            return (f"its layer types ({', '.join(sorted(params))}) use different rotary embeddings, not one "
                    f"rotation per position")
        params = next(iter(params.values()))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if "mrope_section" in params or params.get("mrope_interleaved"):
        return "M-RoPE rotates by several position axes, not one rotation per token"
    if rope_type == "dynamic":
        return "dynamic NTK scaling changes its frequencies with the sequence length"
    if rope_type not in _HF_FIXED:
        return f"rope_type {rope_type!r} is not known to be a fixed rotation per position"
    return None


def blend_refusal(model_config) -> str | None:
    """Why blend mode cannot move keys for the model vLLM serves (``hf_rope_refusal`` of its HF
    config, or a modeling class whose rotary embedding the worker cannot read: vLLM's Transformers
    backend runs the model's own HF modules, e.g. OLMo-2 on vLLM 0.32); None when it can. The API
    process refuses blend requests with it and the worker a blend default, before any weights load."""
    refusal = hf_rope_refusal(model_config.hf_config)
    if refusal is None and model_config.using_transformers_backend():
        return ("vLLM serves this architecture through its Transformers modeling backend, whose rotary embedding "
                "is the model's own HF module, which graphchunk's key rotation does not read")
    return refusal


def _is_rotary(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("RotaryEmbedding") and "Vision" not in name or name in _WHY_NOT
