"""Graph-safety check: a test-only template backend that fails when a replayed forward would not be what a device graph replays.

Contract. A CUDA/NPU graph replays the kernels recorded at capture: they read exactly the tensors
(storage address, offset, shape, stride) they were captured with, and every host-side (Python)
value baked in at capture. ``CheckedBackend(inner)`` wraps another backend. Capture and every
replay also run ``fn(**inputs)`` eagerly under a dispatch mode that logs, per aten op in order, the
op, its non-tensor arguments and the signature of each *external* tensor it reads (one whose
storage no earlier op of the same call produced; views of internal tensors are internal). A replay
must log what the capture logged, else ``GraphSafetyError`` names the op index, op, argument, the
captured and the current value. Caught: a new allocation, re-created buffer or other view where a
static buffer was read; a differing host value (Python scalar, index, shape, tensor literal); a
different op sequence (a Python branch); a host read of a device value (``.item()``, ``nonzero``,
boolean masks), which also fails capture: a graph cannot capture a host sync. The top-level inputs
must keep their capture signatures and values.

``context_reads()`` returns tensors the forward reads outside its arguments (in vLLM: the forward
context's slot mappings / attention metadata, read inside opaque attention ops). The first replay's
dict stands for the capture, because vLLM's runner captures templates without attention metadata;
later replays must keep its keys and each tensor's storage, offset, stride, dtype and device. The
shape may differ: the number of requests in a step varies within a bucket.

The check run executes the forward once more before the inner template replays. That is harmless
for idempotent forwards: the check run writes the same values (e.g. KV at the same slots) that the
replay then writes again. Not seen: host reads that bypass the dispatcher (``tolist()`` or
``numpy()`` on CPU tensors), and reads inside custom ops (``torch.ops.vllm.*`` is one opaque op).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

ContextReads = Callable[[], dict[str, torch.Tensor]]

HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
    "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::unique_dim_consecutive", "aten::bincount"})
MASK_INDEX_OPS = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
LITERAL_OPS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy"})  # torch.tensor(...) in the forward


class GraphSafetyError(RuntimeError):
    """A replay would not compute what a device graph replays (or a capture could not be a graph)."""


def signature(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _describe(entry: tuple) -> str:
    kind, value = entry
    if kind == "tensor":
        ptr, offset, shape, stride, dtype, device = value
        return f"tensor at storage 0x{ptr:x}+{offset} shape {list(shape)} stride {list(stride)} {dtype} {device}"
    return {"internal": "a tensor computed earlier in the forward", "literal": f"tensor literal {value}"}.get(
        kind, repr(value))


def _same(a: tuple, b: tuple) -> bool:
    if a[0] != b[0] or type(a[1]) is not type(b[1]):
        return False
    return a[1] == b[1] or (a[1] != a[1] and b[1] != b[1])  # NaN equals NaN here


def _arguments(func, args: tuple, kwargs: dict):
    """(label, leaf) per argument leaf, labelled by the schema's argument names."""
    names = [arg.name for arg in func._schema.arguments]
    for name, value in [*zip(names, args), *kwargs.items()]:
        if isinstance(value, (list, tuple)):
            yield from ((f"{name}[{i}]", leaf) for i, leaf in enumerate(tree_flatten(value)[0]))
        else:
            yield name, value


def _syncs_host(name: str, leaves: list, kwargs: dict) -> bool:
    if name in HOST_SYNC_OPS:
        return True
    if name in MASK_INDEX_OPS:  # a boolean mask index is a nonzero: its output shape is data-dependent
        return any(label.startswith("indices") and isinstance(leaf, torch.Tensor)
                   and leaf.dtype in (torch.bool, torch.uint8) for label, leaf in leaves)
    return name == "aten::repeat_interleave" and kwargs.get("output_size") is None and any(
        label == "repeats" and isinstance(leaf, torch.Tensor) for label, leaf in leaves)


class ReadLog(TorchDispatchMode):
    """Per dispatched aten op: (op name, ((argument label, entry), ...)); see the module docstring."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []
        self.internal: set[int] = set()  # storages produced by ops of this call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, leaves = func._schema.name, list(_arguments(func, args, kwargs))
        if _syncs_host(name, leaves, kwargs):
            raise GraphSafetyError(f"op {len(self.ops)} {func} reads a device value on the host: "
                                   "a graph cannot capture a host sync")
        self.ops.append((str(func), tuple((label, self._entry(name, leaf)) for label, leaf in leaves)))
        out = func(*args, **kwargs)
        read = set() if name in LITERAL_OPS else {  # a literal's output aliases its fresh input
            leaf.untyped_storage().data_ptr() for _, leaf in leaves if isinstance(leaf, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in read:  # not a view / in-place
                self.internal.add(t.untyped_storage().data_ptr())
        return out

    def _entry(self, op_name: str, leaf: Any) -> tuple:
        if not isinstance(leaf, torch.Tensor):
            return ("value", leaf)
        if op_name in LITERAL_OPS:  # a tensor made from host values outside the dispatcher
            return ("literal", leaf.tolist())
        if leaf.untyped_storage().data_ptr() in self.internal:
            return ("internal", None)
        return ("tensor", signature(leaf))


def record(fn: Callable, inputs: dict[str, Any]) -> list[tuple[str, tuple]]:
    with ReadLog() as log:
        fn(**inputs)
    return log.ops


def compare(captured: list, now: list) -> None:
    for index, ((op, reads), (now_op, now_reads)) in enumerate(zip(captured, now)):
        if op != now_op or len(reads) != len(now_reads):
            raise GraphSafetyError(f"op {index} differs: captured {op} with {len(reads)} arguments, now {now_op} "
                                   f"with {len(now_reads)}: the replayed forward dispatches other ops")
        for (label, entry), (_, now_entry) in zip(reads, now_reads):
            if not _same(entry, now_entry):
                raise GraphSafetyError(f"op {index} {op} argument '{label}' {_why(entry, now_entry)}: "
                                       f"captured {_describe(entry)}, now {_describe(now_entry)}")
    if len(captured) != len(now):
        raise GraphSafetyError(f"op {min(len(captured), len(now))} differs: captured {len(captured)} ops, "
                               f"now {len(now)}: the replayed forward dispatches other ops")


def _why(entry: tuple, now_entry: tuple) -> str:
    if "tensor" in (entry[0], now_entry[0]):
        return "reads a tensor that is not a static buffer it was captured with"
    return "differs from the host-side value baked in at capture"


def _input_entry(value: Any) -> tuple:
    return ("tensor", signature(value)) if isinstance(value, torch.Tensor) else ("value", value)


class CheckedBackend:
    """``uncompiled``: a context in which ``fn`` runs op by op (in vLLM: past its own compiled
    graph, whose generated code allocates and calls kernels out of the dispatcher's sight)."""
    name = "checked"

    def __init__(self, inner, context_reads: ContextReads | None = None,
                 uncompiled: Callable[[], AbstractContextManager] = nullcontext):
        self.inner, self.context_reads, self.uncompiled = inner, context_reads, uncompiled

    def capture(self, fn: Callable, inputs: dict[str, Any]) -> "CheckedTemplate":
        with self.uncompiled():
            ops = record(fn, inputs)
        return CheckedTemplate(fn, inputs, ops, self.inner.capture(fn, inputs), self.context_reads, self.uncompiled)


class CheckedTemplate:
    def __init__(self, fn: Callable, inputs: dict[str, Any], ops: list, inner_template, context_reads=None,
                 uncompiled: Callable[[], AbstractContextManager] = nullcontext):
        self.fn, self.ops, self.inner, self.context_reads = fn, ops, inner_template, context_reads
        self.uncompiled = uncompiled
        self.inputs = {key: _input_entry(value) for key, value in inputs.items()}
        self.context: dict[str, tuple] | None = None  # the first replay's, standing for the capture

    def replay(self, **inputs):
        self._check_inputs(inputs)
        self._check_context()
        with self.uncompiled():
            now = record(self.fn, inputs)
        compare(self.ops, now)
        return self.inner.replay(**inputs)

    def _check_inputs(self, inputs: dict[str, Any]) -> None:
        if set(inputs) != set(self.inputs):
            raise GraphSafetyError(f"inputs {sorted(inputs)} differ from the captured {sorted(self.inputs)}")
        for key, value in inputs.items():
            entry, now = self.inputs[key], _input_entry(value)
            if not _same(entry, now):
                raise GraphSafetyError(f"input '{key}' {_why(entry, now)}: captured {_describe(entry)}, "
                                       f"now {_describe(now)}")

    def _check_context(self) -> None:
        if self.context_reads is None:
            return
        now = {key: _context_signature(t) for key, t in self.context_reads().items()}
        if self.context is None:
            self.context = now
        elif set(now) != set(self.context):
            raise GraphSafetyError(f"context reads {sorted(now)} differ from the first replay's {sorted(self.context)}")
        for key, sig in now.items():
            if sig != self.context[key]:
                raise GraphSafetyError(f"context read '{key}' is not the static buffer of the first replay: "
                                       f"captured {_context_text(self.context[key])}, now {_context_text(sig)}")


def _context_signature(t: torch.Tensor) -> tuple:  # the shape may vary within a bucket
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.stride(), t.dtype, t.device)


def _context_text(sig: tuple) -> str:
    ptr, offset, stride, dtype, device = sig
    return f"storage 0x{ptr:x}+{offset} stride {list(stride)} {dtype} {device}"
