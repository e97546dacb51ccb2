"""What graphchunk's vLLM contract checker matches, shared by both of its resolvers.

A vLLM parameter list (``Param``) and its matching against an entry's ``params`` (``tokens``,
``pattern_problem`` for overrides / patches / hooks, ``call_problem`` for calls); what a lookup
finds (``Obj``) and the one exception a lookup raises (``Unavailable``); and the ``ast`` scans
both the source resolver (``source.py``) and the installed resolver (``installed.py``) run over
vLLM source: ``self_assigned``, ``has_call``, ``has_literal``. Pure functions and data; nothing
here imports vLLM.
"""
from __future__ import annotations

import ast
import dataclasses
from typing import Any


# --- parameters -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str
    """'pos' (positional or keyword, or positional-only), 'kwonly', 'varargs' or 'varkw'."""
    default: bool = False


def tokens(params: list[Param]) -> list[str]:
    """A parameter list as the contract writes one: names, ``*args`` / ``**kwargs`` for variadic
    parameters, ``*`` before keyword-only ones (when there is no ``*args``)."""
    out, star = [], False
    for p in params:
        if p.kind == "varargs":
            out.append("*args")
            star = True
        elif p.kind == "kwonly":
            if not star:
                out.append("*")
                star = True
            out.append(p.name)
        elif p.kind == "varkw":
            out.append("**kwargs")
        else:
            out.append(p.name)
    return out


def pattern_problem(pattern: tuple[str, ...], params: list[Param]) -> str | None:
    """Why vLLM's ``params`` do not fit what graphchunk's override / wrapper assumes (``pattern``)."""
    have = tokens(params)
    shown = f"({', '.join(have)})"
    if pattern and pattern[-1] == "...":
        prefix = list(pattern[:-1])
        if prefix and prefix[-1] == "*":
            prefix = prefix[:-1]
            rest = have[len(prefix):]
            if have[:len(prefix)] != prefix or (rest and rest[0] not in ("*", "**kwargs")):
                return (f"signature is {shown}; graphchunk assumes ({', '.join(prefix)}, then keyword-only "
                        f"parameters)")
            return None
        if have[:len(prefix)] != prefix:
            return f"signature is {shown}; graphchunk assumes it starts ({', '.join(prefix)}, ...)"
        return None
    if have != list(pattern):
        return f"signature is {shown}; graphchunk assumes ({', '.join(pattern)})"
    return None


def call_problem(passed: tuple[str, ...], params: list[Param]) -> str | None:
    """Why a call passing ``passed`` (by name) would not bind to ``params``."""
    names = {p.name for p in params if p.kind in ("pos", "kwonly")}
    kinds = {p.kind for p in params}
    passed_names = [name for name in passed if name not in ("args", "kwargs")]
    unknown = [name for name in passed_names if name not in names]
    if unknown and "varkw" not in kinds:
        return f"has no parameter {', '.join(unknown)} (signature ({', '.join(tokens(params))}))"
    missing = [p.name for p in params if p.kind in ("pos", "kwonly") and not p.default and p.name not in passed]
    if missing:
        return (f"now requires {', '.join(missing)}, which graphchunk does not pass (signature "
                f"({', '.join(tokens(params))}))")
    return None


# --- what a lookup finds --------------------------------------------------------------------------


@dataclasses.dataclass
class Obj:
    kind: str
    """'module', 'class', 'function', 'value' or 'external' (a name from outside vLLM)."""
    value: Any
    """The object (installed) or its ast node (source)."""
    module: str
    bound: bool = False
    """A method found on a class: its first parameter (self / cls) is not part of its params."""
    static: bool = False
    note: str = ""


class Unavailable(Exception):
    """This vLLM module cannot be imported here (a missing third-party package)."""


# --- ast scans (both resolvers read source) ------------------------------------------------------


def self_assigned(tree: ast.AST, name: str) -> bool:
    """A ``self.name = ...`` (or annotated / augmented / tuple) assignment in some method under ``tree``."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args.posonlyargs + node.args.args
        if not args:
            continue
        receiver = args[0].arg
        for inner in ast.walk(node):
            targets: list[ast.AST] = []
            if isinstance(inner, ast.Assign):
                targets = list(inner.targets)
            elif isinstance(inner, (ast.AnnAssign, ast.AugAssign)):
                targets = [inner.target]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                elif isinstance(target, ast.Starred):
                    targets.append(target.value)
                elif (isinstance(target, ast.Attribute) and target.attr == name
                      and isinstance(target.value, ast.Name) and target.value.id == receiver):
                    return True
    return False


def has_call(tree: ast.AST, name: str) -> bool:
    """``name`` called under ``tree`` (``x.name(...)`` or ``name(...)``), or named as a string
    (``collective_rpc("name")``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == name) or (isinstance(func, ast.Name)
                                                                            and func.id == name):
                return True
        elif isinstance(node, ast.Constant) and node.value == name:
            return True
    return False


def has_literal(tree: ast.AST, text: str) -> bool:
    return any(isinstance(node, ast.Constant) and node.value == text for node in ast.walk(tree))
