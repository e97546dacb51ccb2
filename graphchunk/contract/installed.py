"""The installed vLLM, imported and inspected: the resolver ``ImportResolver``.

``ImportResolver()`` imports ``vllm`` (on construction, not on import of this module) and answers
the checker's lookups from the live objects: ``inspect`` for signatures and class members,
dataclass / pydantic / msgspec / NamedTuple / TypedDict introspection for fields, and the
installed source (``inspect.getsource`` + ``ast``) for ``self.x = ...`` assignments, calls and
literals. Where graphchunk's plugin has already wrapped a vLLM method in this process
(``plugin.register``), it reads the vLLM function the wrapper closes over. A module that cannot
be imported here for lack of a third-party package raises ``Unavailable``; the checker then reads
that module from the installed source (``source_root``) with ``SourceResolver``.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from pathlib import Path

from graphchunk.contract.params import Obj, Param, Unavailable, has_call, has_literal, self_assigned


def _params_of_signature(signature: inspect.Signature, bound: bool) -> list[Param]:
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "pos", inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
             inspect.Parameter.KEYWORD_ONLY: "kwonly", inspect.Parameter.VAR_POSITIONAL: "varargs",
             inspect.Parameter.VAR_KEYWORD: "varkw"}
    params = [Param(p.name, kinds[p.kind], p.default is not inspect.Parameter.empty)
              for p in signature.parameters.values()]
    return params[1:] if bound and params and params[0].kind == "pos" else params


def _unwrap(func, name: str):
    """A vLLM function from graphchunk's run-time wrapper of it (the vLLM function the wrapper
    closes over); the function itself when it is vLLM's."""
    seen = set()
    while getattr(func, "__module__", "").startswith("graphchunk") and id(func) not in seen:
        seen.add(id(func))
        originals = [cell.cell_contents for cell in (getattr(func, "__closure__", None) or ())
                     if callable(_cell(cell)) and getattr(_cell(cell), "__name__", None) == name]
        if not originals:
            return None
        func = originals[0]
    return func


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _source_tree(obj) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None


class ImportResolver:
    """The installed vLLM: modules imported, objects inspected."""

    label = "installed"

    def __init__(self):
        import vllm

        self.version = getattr(vllm, "__version__", "?")
        self.source_root = Path(vllm.__file__).resolve().parent.parent

    def _import(self, module: str):
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing == module or module.startswith(missing + ".") and missing.split(".")[0] == "vllm":
                return None
            raise Unavailable(f"{module} does not import here: {exc}") from exc
        except ImportError as exc:
            raise Unavailable(f"{module} does not import here: {exc}") from exc

    def module(self, module: str) -> bool:
        return self._import(module) is not None

    def top(self, module: str, name: str) -> Obj | None:
        mod = self._import(module)
        if mod is None:
            return None
        try:
            value = getattr(mod, name)
        except AttributeError:
            value = self._import(f"{module}.{name}")
            if value is None:
                return None
        return self._obj(value, module)

    @staticmethod
    def _obj(value, module: str, bound: bool = False, static: bool = False) -> Obj:
        if inspect.ismodule(value):
            return Obj("module", value, value.__name__)
        if inspect.isclass(value):
            return Obj("class", value, getattr(value, "__module__", module))
        if callable(value):
            return Obj("function", value, getattr(value, "__module__", module), bound=bound, static=static)
        return Obj("value", value, module)

    def member(self, cls: Obj, name: str) -> Obj | None:
        for klass in inspect.getmro(cls.value):
            if name not in vars(klass):
                continue
            raw = vars(klass)[name]
            if isinstance(raw, staticmethod):
                return self._obj(raw.__func__, klass.__module__, static=True)
            if isinstance(raw, classmethod):
                return self._obj(raw.__func__, klass.__module__, bound=True)
            if isinstance(raw, (property,)) or type(raw).__name__ == "cached_property":
                return Obj("function", raw, klass.__module__, note="property")
            if inspect.isfunction(raw):
                func = _unwrap(raw, name)
                if func is None:
                    return Obj("value", raw, klass.__module__, note="wrapped by graphchunk; vLLM's original not found")
                return self._obj(func, klass.__module__, bound=True)
            return self._obj(raw, klass.__module__)
        return None

    def fields(self, cls: Obj) -> set[str] | None:
        klass = cls.value
        if dataclasses.is_dataclass(klass):
            return {f.name for f in dataclasses.fields(klass)}
        for attr in ("model_fields", "__struct_fields__", "_fields"):
            names = getattr(klass, attr, None)
            if isinstance(names, (dict, tuple, list)):
                return set(names)
        if isinstance(getattr(klass, "__annotations__", None), dict) and type(klass).__name__ == "_TypedDictMeta":
            return set(klass.__annotations__)
        return None

    def instance_attr(self, cls: Obj, name: str) -> str | None:
        for klass in inspect.getmro(cls.value):
            if name in vars(klass).get("__annotations__", {}):
                return f"annotated in {klass.__name__}"
        for klass in inspect.getmro(cls.value):
            if not klass.__module__.startswith("vllm"):
                continue
            tree = _source_tree(klass)
            if tree is not None and self_assigned(tree, name):
                return f"assigned in {klass.__name__}"
        return None

    def signature(self, obj: Obj) -> list[Param] | None:
        try:
            signature = inspect.signature(obj.value)
        except (TypeError, ValueError):
            return None
        return _params_of_signature(signature, obj.bound and obj.kind == "function")

    def calls(self, where: str, name: str) -> bool | None:
        module, _, cls = where.partition(":")
        mod = self._import(module)
        if mod is None:
            return None
        target = getattr(mod, cls, None) if cls else mod
        if target is None:
            return None
        tree = _source_tree(target)
        return None if tree is None else has_call(tree, name)

    def literal(self, module: str, text: str) -> bool | None:
        mod = self._import(module)
        if mod is None:
            return None
        tree = _source_tree(mod)
        return None if tree is None else has_literal(tree, text)
