"""Graph-template hooks of the chunk-aware model runner (``graphs/templates.py`` does the capture/replay).

``graphchunk_capture_templates`` captures graphchunk's templates (backends ``compile``, ``eager``)
over vLLM's persistent input buffers at start-up; with backend ``vllm`` vLLM captures its own
graphs and there is nothing to do. Per step, ``_plan_step`` (``model_runner.py``) sets ``gc_step``
when the step has a cached-chunk prefill, with the bucket holding it when every request computes
only its question over cached context. ``_determine_batch_execution_and_padding`` pads the step to
that bucket's token count through vLLM's own padding path (graphchunk's templates; vLLM's
dispatcher pads to its capture sizes by itself) and decides how the step runs;
``_model_forward`` replays the bucket's template or runs vLLM's forward, and counts the step.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from graphchunk.graphs.buckets import Bucket


@dataclasses.dataclass
class StepGraph:
    """How this step's cached-chunk prefill runs: the bucket holding it, and the outcome counted."""
    bucket: Bucket | None
    outcome: str = "eager"


class TemplateHooksMixin:
    """Methods of ``ChunkRunnerMixin``; ``gc_templates`` and ``gc_step`` are set up there."""

    def graphchunk_capture_templates(self) -> None:
        """Captures every bucket of the grid over vLLM's persistent input buffers (before any request)."""
        if self.gc_templates is None or not self.gc_templates.captures:
            return
        from vllm.forward_context import set_forward_context

        def inputs_for(bucket: Bucket) -> dict:
            n = bucket.num_tokens
            self.input_ids.gpu[:n] = 0
            self.positions[:n] = 0
            return dict(input_ids=self.input_ids.gpu[:n], positions=self.positions[:n],
                        intermediate_tensors=None, inputs_embeds=None)

        def context_for(bucket: Bucket):
            """No attention metadata: attention and KV writes are skipped. The padding mask MoE
            routing reads (``VLLM_MOE_SKIP_PADDING``) is vLLM's own buffer over the bucket's
            tokens, as vLLM's captures and the steps replaying the template pass it: a router
            traced into the template must see at capture the tensor it reads at replay."""
            return set_forward_context(None, self.vllm_config, num_tokens=bucket.num_tokens, slot_mapping={},
                                       is_padding=self._padding_mask(bucket.num_tokens))

        with torch.inference_mode():
            self.gc_templates.capture_all(self.model, inputs_for, context_for, self.device)
        self._publish()

    def _determine_batch_execution_and_padding(self, num_tokens, *args, **kwargs):
        result = super()._determine_batch_execution_and_padding(num_tokens, *args, **kwargs)
        step = self.gc_step
        if step is None:
            return result
        mode, batch_desc, *rest = result
        if self.gc_templates.captures:
            if step.bucket is not None:
                batch_desc = dataclasses.replace(batch_desc, num_tokens=step.bucket.num_tokens)
                step.outcome = "padded" if step.bucket.num_tokens > num_tokens else "replayed"
        elif self._vllm_runs_graph(mode):
            step.outcome = "padded" if batch_desc.num_tokens > num_tokens else "replayed"
        return (mode, batch_desc, *rest)

    def _vllm_runs_graph(self, mode) -> bool:
        """vLLM replays a captured graph (CUDA/ACL), or runs its one compiled dynamic-shape graph (CPU)."""
        from vllm.config import CompilationMode, CUDAGraphMode

        if mode != CUDAGraphMode.NONE:
            return True
        return self.device.type == "cpu" and self.compilation_config.mode != CompilationMode.NONE

    def _model_forward(self, *args, **inputs):
        step, self.gc_step = self.gc_step, None
        eager = super()._model_forward
        if step is None:
            return eager(*args, **inputs)
        templates = self.gc_templates
        if templates.captures and step.outcome != "eager" and not args:
            output, replayed = templates.replay(step.bucket, eager, **inputs)
            templates.count(step.outcome if replayed else "eager", step.bucket)
            return output
        templates.count(step.outcome, step.bucket)
        return eager(*args, **inputs)

    def _forward_context_reads(self) -> dict[str, torch.Tensor]:
        """Tensors the forward reads outside its arguments (inside vLLM's attention op): the graph
        safety check (``graphs/graph_safety.py``) requires them to stay the same static buffers."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        reads = {f"slot_mapping[{name}]": t for name, t in (context.slot_mapping or {}).items()
                 if isinstance(t, torch.Tensor)}
        metadata = context.attn_metadata
        first = next(iter(metadata.values()), None) if isinstance(metadata, dict) else metadata
        for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            value = getattr(first, field, None)
            if isinstance(value, torch.Tensor):
                reads[f"attn_metadata.{field}"] = value
        return reads


@contextlib.contextmanager
def past_vllm_compiled_graph():
    """vLLM's compiled models run their plain forward while the forward context says so."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    saved, context.skip_compiled = context.skip_compiled, True
    try:
        yield
    finally:
        context.skip_compiled = saved
