"""Graph-template hooks of the chunk-aware model runner (``graphs/templates.py`` does the capture/replay).

``graphchunk_capture_templates`` captures every bucket of the grid over vLLM's persistent input
buffers at start-up; per step, ``_plan_step`` (``model_runner.py``) sets ``gc_bucket`` when every
request computes only its question over cached context, ``_determine_batch_execution_and_padding``
pads the step to the bucket's token count through vLLM's own padding path, and ``_model_forward``
replays the bucket's template (eager when none is chosen).
"""
from __future__ import annotations

import dataclasses

import torch

from graphchunk.graphs.buckets import Bucket


class TemplateHooksMixin:
    """Methods of ``ChunkRunnerMixin``; ``gc_templates`` and ``gc_bucket`` are set up there."""

    def graphchunk_capture_templates(self) -> None:
        """Captures every bucket of the grid over vLLM's persistent input buffers (before any request)."""
        if self.gc_templates is None:
            return
        from vllm.forward_context import set_forward_context

        def inputs_for(bucket: Bucket) -> dict:
            n = bucket.num_tokens
            self.input_ids.gpu[:n] = 0
            self.positions[:n] = 0
            return dict(input_ids=self.input_ids.gpu[:n], positions=self.positions[:n],
                        intermediate_tensors=None, inputs_embeds=None)

        def context_for(bucket: Bucket):  # no attention metadata: attention and KV writes are skipped
            return set_forward_context(None, self.vllm_config, num_tokens=bucket.num_tokens, slot_mapping={})

        with torch.inference_mode():
            self.gc_templates.capture_all(self.model, inputs_for, context_for, self.device)
        self._publish()

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        result = super()._determine_batch_execution_and_padding(*args, **kwargs)
        if self.gc_bucket is None:
            return result
        mode, batch_desc, *rest = result
        return (mode, dataclasses.replace(batch_desc, num_tokens=self.gc_bucket.num_tokens), *rest)

    def _model_forward(self, **inputs):
        bucket, self.gc_bucket = self.gc_bucket, None
        eager = super()._model_forward
        return eager(**inputs) if bucket is None else self.gc_templates.replay(bucket, eager, **inputs)
