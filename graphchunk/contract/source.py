"""vLLM's source tree read with ``ast``: the resolver ``SourceResolver``, nothing imported.

``SourceResolver(root)`` answers the checker's lookups (``module``, ``top``, ``member``,
``fields``, ``instance_attr``, ``signature``, ``calls``, ``literal``) from the ``.py`` files under
``root/vllm/...``, so an unpacked wheel of another vLLM release is judged without installing it.
Re-exports, star imports, ``TYPE_CHECKING`` blocks and lazy module ``__getattr__`` are followed;
bases are resolved through the tree; dataclass-like classes (``@dataclass``, vLLM's ``@config``,
pydantic / msgspec / typing bases) have their fields and constructor read from annotations. A
class graphchunk only reaches through objects is also looked for anywhere in the tree
(``find_class``), and a missing import names where the name is defined now (``hint``).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

from graphchunk.contract.params import Obj, Param, has_call, has_literal, self_assigned


def _annotation_is_classvar(annotation: ast.AST) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return (isinstance(target, ast.Name) and target.id == "ClassVar") or (
        isinstance(target, ast.Attribute) and target.attr == "ClassVar") or (
        isinstance(target, ast.Constant) and isinstance(target.value, str) and target.value.startswith("ClassVar"))


def _params_of(node: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> list[Param]:
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    params = [Param(arg.arg, "pos", d) for arg, d in zip(positional, defaults)]
    if a.vararg:
        params.append(Param(a.vararg.arg, "varargs"))
    params += [Param(arg.arg, "kwonly", d is not None) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "varkw"))
    return params[1:] if bound and params and params[0].kind == "pos" else params


def _decorator_names(node) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)
    return names


_DATACLASS_DECORATORS = {"dataclass", "config"}
"""Decorators that make a class's annotated names its fields (``@dataclass``, vLLM's ``@config``)."""
_FIELD_BASES = {"BaseModel", "Struct", "NamedTuple", "TypedDict"}
"""External bases whose subclasses' annotated names are fields (pydantic, msgspec, typing)."""


def _field_default(value: ast.AST | None) -> tuple[bool, bool]:
    """(has a default, is an __init__ parameter) of an annotated class-level name with ``value``."""
    if value is None:
        return False, True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in ("field", "Field"):
            keywords = {k.arg: k.value for k in value.keywords}
            init = keywords.get("init")
            in_init = not (isinstance(init, ast.Constant) and init.value is False)
            positional = value.args[0] if value.args else None
            has = ("default" in keywords or "default_factory" in keywords
                   or (positional is not None and not (isinstance(positional, ast.Constant)
                                                       and positional.value is Ellipsis)))
            return has, in_init
    return True, True


class SourceResolver:
    """vLLM's source tree under ``root`` (``root/vllm/...``), read with ``ast``; nothing imported."""

    label = "source"
    searches_tree = True
    """It can look a name up anywhere in the tree (``find_class``, ``hint``): moved classes are found."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._trees: dict[str, ast.Module | None] = {}
        self._classes: dict[str, list[Obj]] | None = None

    # modules
    def _path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def _is_package(self, module: str) -> bool:
        return (self.root.joinpath(*module.split(".")) / "__init__.py").is_file()

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self._path(module)
            self._trees[module] = ast.parse(path.read_text(encoding="utf-8"), str(path)) if path else None
        return self._trees[module]

    def module(self, module: str) -> bool:
        return self._path(module) is not None

    # names
    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        package = parts if self._is_package(module) else parts[:-1]
        package = package[:len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else []))

    @staticmethod
    def _top_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        """Module-level statements, including those in if / try / with blocks."""
        for stmt in body:
            yield stmt
            if isinstance(stmt, ast.If):
                yield from SourceResolver._top_statements(stmt.body + stmt.orelse)
            elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
                handlers = [s for h in stmt.handlers for s in h.body]
                yield from SourceResolver._top_statements(stmt.body + handlers + stmt.orelse + stmt.finalbody)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                yield from SourceResolver._top_statements(stmt.body)

    def top(self, module: str, name: str, _seen: frozenset = frozenset()) -> Obj | None:
        if (module, name) in _seen:
            return None
        _seen = _seen | {(module, name)}
        tree = self.tree(module)
        if tree is None:
            return None
        definition = value = imported = None
        stars = []
        for stmt in self._top_statements(tree.body):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                definition = definition or Obj("class", stmt, module)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                definition = definition or Obj("function", stmt, module)
            elif isinstance(stmt, ast.Assign):
                names = [t.id for target in stmt.targets
                         for t in ([target] + (list(target.elts) if isinstance(target, ast.Tuple) else []))
                         if isinstance(t, ast.Name)]
                if name in names:
                    value = value or Obj("value", stmt, module)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                value = value or Obj("value", stmt, module)
            elif isinstance(stmt, ast.ImportFrom):
                source = self._absolute(module, stmt)
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name and imported is None:
                        imported = self._imported(source, alias.name, _seen)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name and imported is None:
                        imported = (Obj("module", None, alias.name) if self.module(alias.name)
                                    else Obj("external", None, alias.name))
        found = definition or imported or value
        if found is not None:
            return found
        for source in stars:
            if source.split(".")[0] == "vllm":
                found = self.top(source, name, _seen)
                if found is not None:
                    return found
        if self._is_package(module) and self.module(f"{module}.{name}"):
            return Obj("module", None, f"{module}.{name}")
        lazy = any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == "__getattr__"
                   for s in tree.body)
        if lazy and has_literal(tree, name):
            return Obj("value", None, module, note="served by the module's lazy __getattr__")
        return None

    def _imported(self, source: str, name: str, seen: frozenset) -> Obj:
        if source.split(".")[0] != "vllm":
            return Obj("external", None, f"{source}.{name}")
        found = self.top(source, name, seen)
        if found is not None:
            return found
        if self.module(f"{source}.{name}"):
            return Obj("module", None, f"{source}.{name}")
        return Obj("external", None, f"{source}.{name}")  # a broken re-export: not vLLM's name here

    def _resolve_expr(self, module: str, expr: ast.AST) -> Obj | None:
        if isinstance(expr, ast.Subscript):
            return self._resolve_expr(module, expr.value)
        if isinstance(expr, ast.Name):
            found = self.top(module, expr.id)
            return found if found is not None else Obj("external", None, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self._resolve_expr(module, expr.value)
            if owner is None:
                return None
            if owner.kind == "module":
                found = self.top(owner.module, expr.attr)
                return found if found is not None else Obj("external", None, f"{owner.module}.{expr.attr}")
            if owner.kind == "external":
                return Obj("external", None, f"{owner.module}.{expr.attr}")
        return None

    def mro(self, cls: Obj) -> Iterator[Obj]:
        """The class and its bases found in the tree, depth first (external bases as 'external')."""
        seen = set()
        stack = [cls]
        while stack:
            current = stack.pop(0)
            if current.kind != "class":
                yield current
                continue
            key = (current.module, current.value.name, current.value.lineno)
            if key in seen:
                continue
            seen.add(key)
            yield current
            bases = [self._resolve_expr(current.module, base) for base in current.value.bases]
            stack = [b for b in bases if b is not None] + stack

    def _definitions(self) -> dict[str, list[Obj]]:
        """Every module-level class and function of the tree, by name (read once, on demand)."""
        if self._classes is None:
            self._classes = {}
            for path in sorted((self.root / "vllm").rglob("*.py")):
                module = ".".join(path.relative_to(self.root).with_suffix("").parts).removesuffix(".__init__")
                tree = self._trees.get(module)
                if tree is None:
                    try:
                        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
                    except SyntaxError:
                        continue
                    self._trees[module] = tree
                for stmt in tree.body:
                    if isinstance(stmt, ast.ClassDef):
                        self._classes.setdefault(stmt.name, []).append(Obj("class", stmt, module))
                    elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self._classes.setdefault(stmt.name, []).append(Obj("function", stmt, module))
        return self._classes

    def find_class(self, name: str) -> list[Obj]:
        """Every class of this name anywhere in the tree (for classes graphchunk does not import)."""
        return [obj for obj in self._definitions().get(name, []) if obj.kind == "class"]

    def hint(self, name: str) -> str:
        """Where a name graphchunk imports is defined now, if anywhere (for a failure's message)."""
        places = sorted({obj.module for obj in self._definitions().get(name, [])})
        return f" (a {name} is defined in {', '.join(places)})" if places else ""

    # members
    def member(self, cls: Obj, name: str) -> Obj | None:
        for klass in self.mro(cls):
            if klass.kind != "class":
                continue
            defs = [stmt for stmt in self._top_statements(klass.value.body)
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name]
            if defs:  # the last definition wins; @overload stubs only describe it
                decorators = [_decorator_names(stmt) for stmt in defs]
                chosen = [d for d, names in zip(defs, decorators) if "overload" not in names] or defs
                names = _decorator_names(chosen[-1])
                is_property = any(names & {"property", "cached_property"} for names in decorators)
                return Obj("function", chosen[-1], klass.module, bound="staticmethod" not in names,
                           static="staticmethod" in names, note="property" if is_property else "")
            for stmt in self._top_statements(klass.value.body):
                if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                        for t in stmt.targets):
                    return Obj("value", stmt, klass.module)
                if (isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name)
                        and stmt.target.id == name and not self._is_fields_class(klass)):
                    return Obj("value", stmt, klass.module)
                if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                    return Obj("class", stmt, klass.module)
        return None

    def _is_fields_class(self, klass: Obj) -> bool:
        if _decorator_names(klass.value) & _DATACLASS_DECORATORS:
            return True
        return any(b.kind == "external" and b.module.split(".")[-1] in _FIELD_BASES
                   for b in self.mro(klass) if b is not klass)

    def _fields(self, cls: Obj) -> list[tuple[str, bool, bool]] | None:
        """(name, has default, in __init__) of a dataclass-like class's fields, bases first."""
        classes = [k for k in self.mro(cls) if k.kind == "class"]
        if not any(self._is_fields_class(k) for k in classes):
            return None
        fields: dict[str, tuple[str, bool, bool]] = {}
        for klass in reversed(classes):
            if not self._is_fields_class(klass):
                continue
            for stmt in klass.value.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and not _annotation_is_classvar(stmt.annotation)):
                    has_default, in_init = _field_default(stmt.value)
                    fields[stmt.target.id] = (stmt.target.id, has_default, in_init)
        return list(fields.values())

    def fields(self, cls: Obj) -> set[str] | None:
        found = self._fields(cls)
        return None if found is None else {name for name, _, _ in found}

    def instance_attr(self, cls: Obj, name: str) -> str | None:
        for klass in self.mro(cls):
            if klass.kind != "class":
                continue
            for stmt in klass.value.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                    return f"annotated in {klass.value.name}"
            if self_assigned(klass.value, name):
                return f"assigned in {klass.value.name}"
        return None

    def signature(self, obj: Obj) -> list[Param] | None:
        if obj.kind == "function":
            return _params_of(obj.value, obj.bound)
        if obj.kind == "class":
            return self.constructor(obj)
        return None

    def constructor(self, cls: Obj) -> list[Param] | None:
        for klass in self.mro(cls):
            if klass.kind != "class":
                return None  # an external base's __init__: unknown here
            for stmt in klass.value.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == "__init__":
                    return _params_of(stmt, True)
            if self._is_fields_class(klass):
                fields = self._fields(klass) or []
                return [Param(name, "pos", has_default) for name, has_default, in_init in fields if in_init]
        return []

    def calls(self, where: str, name: str) -> bool | None:
        module, _, cls = where.partition(":")
        tree = self.tree(module)
        if tree is None:
            return None
        if cls:
            found = self.top(module, cls)
            if found is None or found.kind not in ("class", "function"):
                return None
            return has_call(found.value, name)
        return has_call(tree, name)

    def literal(self, module: str, text: str) -> bool | None:
        tree = self.tree(module)
        return None if tree is None else has_literal(tree, text)
