"""What the loaded model allows of blend mode, decided once at start-up (``BlendSupport.of``).

Blend needs keys it can move (``blend/rope.py``); CacheBlend also a decoder whose layer range can
be narrowed for its check pass (``first_layers``). Without them blend is refused at
start-up when it is the deployment's default mode; otherwise the API process refuses blend
requests from the model's config (``rope.blend_refusal``), and a blend request that still
arrives runs as a full prefill (``refusal`` / ``check_refusal`` go to the scheduler's connector in
the workers' handshake: ``context_scheduler.PoolHandshake.runs``): exactly blend's target.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from graphchunk.blend.rope import KeyRotation
from graphchunk.config import ConfigError, GraphChunkConfig
from graphchunk.log import logger


@dataclass(frozen=True)
class BlendSupport:
    rotation: KeyRotation | None
    """Moves cached keys to new positions; None: this model cannot blend (``refusal`` says why)."""
    refusal: str | None = None
    check_refusal: str | None = None
    """Why CacheBlend's check pass cannot run on this model; None: it can."""

    @classmethod
    def of(cls, model, max_model_len: int, config: GraphChunkConfig) -> "BlendSupport":
        """Raises ConfigError when blend is the default mode (``config.mode``) and cannot run."""
        rotation = refusal = check_refusal = None
        try:
            rotation = KeyRotation.from_model(model)
            if rotation.max_delta + 1 < max_model_len:
                raise ConfigError(f"the rotary cache holds {rotation.max_delta + 1} positions, fewer than "
                                  f"max_model_len={max_model_len}")
        except ConfigError as exc:
            rotation, refusal = None, str(exc)
            if config.mode == "blend":
                raise
            logger.warning("graphchunk: blend mode unavailable for this model (full prefill instead): %s", exc)
        try:
            decoder = decoder_stack(model)
            num_layers = decoder.end_layer - decoder.start_layer
            if config.check_layer >= num_layers:
                raise ConfigError(f"graphchunk.check_layer={config.check_layer} must be below the "
                                  f"model's {num_layers} layers")
        except ConfigError as exc:
            check_refusal = str(exc)
            if config.mode == "blend" and config.policy.needs_check:
                raise
            logger.warning("graphchunk: CacheBlend unavailable (full prefill instead): %s", exc)
        return cls(rotation, refusal, check_refusal)


@contextlib.contextmanager
def first_layers(model: torch.nn.Module, num_layers: int | None):
    """Runs ``model``'s decoder over its first ``num_layers`` layers only (all when None)."""
    if num_layers is None:
        yield
        return
    decoder = decoder_stack(model)
    saved = decoder.end_layer
    decoder.end_layer = min(saved, decoder.start_layer + num_layers)
    try:
        yield
    finally:
        decoder.end_layer = saved


def decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the decoder layers and the ``[start_layer, end_layer)`` range it runs."""
    for module in model.modules():
        if all(hasattr(module, name) for name in ("layers", "start_layer", "end_layer")):
            return module
    raise ConfigError(f"graphchunk CacheBlend needs a decoder with a layer range (start_layer/end_layer); "
                      f"{type(model).__name__} has none")
