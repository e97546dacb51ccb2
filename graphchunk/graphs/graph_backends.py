"""Template backends: one interface to capture a forward at a static shape and replay it.

``backend.capture(fn, inputs)`` runs ``fn(**inputs)`` at the bucket's shape and returns a
template; ``template.replay(**inputs)`` computes ``fn`` on new values of the same shapes. Graph
backends copy those values into the static buffers captured with (a no-op when the caller
already wrote them there, as vLLM's persistent input buffers do).

* ``eager``      calls ``fn``: the exact fallback, and the reference in tests.
* ``compile``    torch.compile with static shapes (CPU); a replay never recompiles
                 (``fail_on_recompile``), so a replay counted is a replay done.
* ``cuda_graph`` torch.cuda.CUDAGraph, one memory pool shared by all templates.
* ``npu_graph``  torch.npu.NPUGraph (torch-npu mirrors the CUDA graph API); unverified on hardware.

The device-graph backends serve standalone use (``perf/``); inside vLLM, vLLM's own CUDA graphs
and vllm-ascend's ACL graphs replay the buckets (grid backend ``vllm``, ``engine/graph_config.py``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

Forward = Callable[..., Any]


class ReplayMiss(RuntimeError):
    """The template cannot run these inputs as captured (nothing was computed); run eager."""


class EagerBackend:
    name = "eager"

    def capture(self, fn: Forward, inputs: dict[str, Any]) -> "EagerTemplate":
        fn(**inputs)
        return EagerTemplate(fn)


class EagerTemplate:
    def __init__(self, fn: Forward):
        self.fn = fn

    def replay(self, **inputs):
        return self.fn(**inputs)


class CompileBackend:
    """One compiled callable per backend: templates of the same shape share its graph."""
    name = "compile"

    def __init__(self, max_templates: int, compile_backend: Any = "inductor"):
        import torch._dynamo

        # Each static shape is one dynamo cache entry; past the limit dynamo would silently run eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, max_templates + 8)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * (max_templates + 8))
        self.compile_backend = compile_backend
        self.compiled: dict[int, Forward] = {}

    def capture(self, fn: Forward, inputs: dict[str, Any]) -> "CompiledTemplate":
        compiled = self.compiled.setdefault(id(fn), torch.compile(fn, dynamic=False, backend=self.compile_backend))
        compiled(**inputs)
        return CompiledTemplate(compiled)


class CompiledTemplate:
    def __init__(self, compiled: Forward):
        self.compiled = compiled

    def replay(self, **inputs):
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self.compiled(**inputs)
        except RuntimeError as exc:
            if "Detected recompile" in str(exc):  # raised before the frame ran: nothing computed
                raise ReplayMiss(str(exc)) from exc
            raise


class DeviceGraphBackend:
    """CUDA graphs, or NPU graphs through torch-npu's identical API (``torch.npu``)."""

    def __init__(self, device_module: Any, graph_class: str, name: str, warmup_runs: int = 2):
        self.mod, self.graph_class, self.name, self.warmup_runs = device_module, graph_class, name, warmup_runs
        self.pool = device_module.graph_pool_handle()

    def capture(self, fn: Forward, inputs: dict[str, Any]) -> "DeviceGraphTemplate":
        stream = self.mod.Stream()
        stream.wait_stream(self.mod.current_stream())
        with self.mod.stream(stream):  # allocator warm-up outside the graph, as torch's docs require
            for _ in range(self.warmup_runs):
                fn(**inputs)
        self.mod.current_stream().wait_stream(stream)
        graph = getattr(self.mod, self.graph_class)()
        with self.mod.graph(graph, pool=self.pool):
            output = fn(**inputs)
        return DeviceGraphTemplate(graph, inputs, output)


class DeviceGraphTemplate:
    def __init__(self, graph, static_inputs: dict[str, Any], output):
        self.graph, self.static_inputs, self.output = graph, static_inputs, output

    def replay(self, **inputs):
        for key, value in inputs.items():
            static = self.static_inputs[key]
            if isinstance(static, torch.Tensor):
                if static.shape != value.shape:
                    raise ReplayMiss(f"input {key} has shape {tuple(value.shape)}, captured {tuple(static.shape)}")
                if static.data_ptr() != value.data_ptr():
                    static.copy_(value, non_blocking=True)
            elif static != value:
                raise ReplayMiss(f"input {key}={value!r}, captured {static!r}")
        self.graph.replay()
        return self.output


def make_backend(name: str, max_templates: int):
    if name == "eager":
        return EagerBackend()
    if name == "compile":
        return CompileBackend(max_templates)
    if name == "cuda_graph":
        if not torch.cuda.is_available():
            raise RuntimeError("graph template backend 'cuda_graph' needs a CUDA device")
        return DeviceGraphBackend(torch.cuda, "CUDAGraph", name)
    if name == "npu_graph":
        return DeviceGraphBackend(_import_npu(), "NPUGraph", name)
    raise ValueError(f"unknown graph template backend {name!r}")


def _import_npu():
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError as exc:
        raise ImportError("NPU graph templates need torch-npu (pip install 'graphchunk[ascend]')") from exc
    return torch.npu
