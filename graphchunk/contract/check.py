"""Checks graphchunk's contract with vLLM (``graphchunk/contract/names.py``) against each vLLM it admits.

    python -m graphchunk.contract.check                 # the installed vLLM (import + inspect) and the
                                                        # recorded source of every other admitted release
    python -m graphchunk.contract.check --results perf/results/vllm_contract.json   # and write the outcome
    python -m graphchunk.contract.check --source DIR    # a source tree (DIR/vllm/...) instead: ast only

Each check reads the entries for its release (``Name.releases``; a name that moved between releases
has one entry per place, ``graphchunk.compat.MOVED``). The other admitted releases are read from
their records (``graphchunk/contract/records/vllm-X.json``, written by ``python -m
graphchunk.contract.record X`` from the release's wheel, its sha256 kept): an entry the record cannot
answer fails, naming that command. ``--source`` reads a tree with ``ast`` and imports nothing from
it, so an unpacked wheel of a release not yet admitted is judged without installing it. Prints one
line per failing entry naming what broke, then a summary per release; exits 1 if any fail.

The installed check imports the modules and inspects the objects. Where graphchunk's plugin has
already wrapped a vLLM method in this process (``plugin.register``), the check reads the vLLM
function the wrapper closes over. A module that cannot be imported on this machine for lack of a
third-party package (FlashInfer's backend without ``flashinfer``) is checked from its installed
source instead, and says so.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import hashlib
import json
import shlex
import sys
from pathlib import Path

from graphchunk.compat import RELEASES, UnsupportedVLLM, release_of
from graphchunk.contract.installed import ImportResolver
from graphchunk.contract.names import NAMES, Name
from graphchunk.contract.params import Obj, Unavailable, call_problem, pattern_problem
from graphchunk.contract.record import NotRecorded, RecordResolver, record_path, recorded_versions
from graphchunk.contract.source import SourceResolver


# --- the check ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Result:
    name: Name
    ok: bool
    reason: str = ""
    """Why it failed; for a pass, a note or ''."""


def check_entry(entry: Name, resolver) -> Result:
    """One entry against one resolver (``ImportResolver``, ``SourceResolver`` or a record's)."""
    try:
        problem, note = _check(entry, resolver)
    except NotRecorded as exc:
        return Result(entry, False, str(exc))
    except Unavailable as exc:
        if not isinstance(resolver, ImportResolver):
            raise
        problem, note = _check(entry, SourceResolver(resolver.source_root))
        note = f"{exc}; checked from the installed source" + (f"; {note}" if note else "")
    return Result(entry, problem is None, problem if problem is not None else note)


def _check(entry: Name, r) -> tuple[str | None, str]:
    kind, module, qualname = entry.kind, entry.module, entry.qualname
    if kind == "module":
        return (None, "") if r.module(module) else (f"module {module} not found", "")
    if kind == "literal":
        found = r.literal(module, qualname)
        if found is None:
            return f"module {module} not found", ""
        return (None, "") if found else (f"no string {qualname!r} in {module}", "")
    def hint() -> str:
        return r.hint(qualname.split(".")[0]) if getattr(r, "searches_tree", False) else ""

    if not r.module(module) and kind in ("import", "subclass", "classname"):
        return f"module {module} not found{hint()}", ""

    if kind in ("import", "subclass", "classname") or (kind == "call" and "." not in qualname):
        obj = r.top(module, qualname)
        if obj is None or obj.kind == "external":
            return f"{module} has no name {qualname}{hint()}", ""
        if kind in ("subclass", "classname") and obj.kind != "class":
            return f"{module}.{qualname} is not a class", ""
        if kind != "call":
            return None, obj.note
        return _check_call(entry, r, obj)

    owner_name, _, attr = qualname.rpartition(".")
    owner, note = _owner(entry, r, owner_name)
    if owner is None:
        return note, ""
    if kind in ("override", "patch", "hook"):
        method = r.member(owner, attr)
        if method is None:
            return f"{owner_name} has no method {attr} (in the class or its bases)", note
        if method.kind != "function" or method.note == "property":
            return f"{owner_name}.{attr} is not a method" + (f" ({method.note})" if method.note else ""), note
        if entry.params is not None:
            params = r.signature(method)
            if params is None:
                return f"{owner_name}.{attr}: signature not readable", note
            problem = pattern_problem(entry.params, params)
            if problem:
                return f"{owner_name}.{attr}: {problem}", note
        for caller in entry.callers:
            called = r.calls(caller, attr)
            if called is None:
                return f"{owner_name}.{attr}: its caller {caller} is not found", note
            if not called:
                return f"{owner_name}.{attr} is no longer called in {caller}", note
        return None, note
    if kind == "call":
        method = r.member(owner, attr)
        if method is None:
            return f"{owner_name} has no method {attr} (in the class or its bases)", note
        problem, more = _check_call(entry, r, method)
        return problem, "; ".join(x for x in (note, more) if x)
    if kind == "field":
        fields = r.fields(owner)
        if fields is None:
            return f"{owner_name} is not a dataclass-like class (graphchunk needs its field {attr})", note
        return (None, note) if attr in fields else (f"{owner_name} has no field {attr}", note)
    if kind == "attribute":
        if r.member(owner, attr) is not None:
            return None, note
        fields = r.fields(owner)
        if fields is not None and attr in fields:
            return None, note
        if r.instance_attr(owner, attr):
            return None, note
        return (f"{owner_name} has no attribute {attr} (no class attribute, field, annotation or self.{attr} "
                f"assignment in the class or its bases)"), note
    return f"unknown kind {kind}", ""


def _owner(entry: Name, r, owner_name: str) -> tuple[Obj | None, str]:
    """The class ``owner_name`` of ``entry.module`` (a class graphchunk only reaches through objects
    may have moved: the source checker finds it elsewhere and notes it)."""
    parts = owner_name.split(".")
    obj = r.top(entry.module, parts[0]) if r.module(entry.module) else None
    for part in parts[1:]:
        obj = r.member(obj, part) if obj is not None and obj.kind == "class" else None
    if obj is not None and obj.kind == "class":
        return obj, ""
    if getattr(r, "searches_tree", False) and len(parts) == 1:
        moved = r.find_class(owner_name)
        if len(moved) >= 1:
            places = sorted({m.module for m in moved})
            return moved[0], f"{owner_name} is no longer in {entry.module}; found in {', '.join(places)}"
    if not r.module(entry.module):
        return None, f"module {entry.module} not found"
    return None, f"{entry.module} has no class {owner_name}"


def _check_call(entry: Name, r, obj: Obj) -> tuple[str | None, str]:
    if entry.params is None:
        return None, obj.note
    if obj.kind not in ("function", "class") or obj.note == "property":
        return f"{entry.qualname} is not callable here ({obj.kind})", obj.note
    params = r.signature(obj)
    if params is None:
        return f"{entry.qualname}: signature not readable", obj.note
    problem = call_problem(entry.params, params)
    return (f"{entry.qualname} {problem}" if problem else None), obj.note


def check(resolver, names: tuple[Name, ...] = NAMES, release: str | None = None) -> list[Result]:
    """Each of ``names`` that is for ``release`` (major.minor; None: every entry) against ``resolver``."""
    return [check_entry(entry, resolver) for entry in names if release is None or entry.applies_to(release)]


# --- reporting ------------------------------------------------------------------------------------


def summary(results: list[Result]) -> str:
    failed = [r for r in results if not r.ok]
    by_scope = {}
    for r in failed:
        by_scope[r.name.scope] = by_scope.get(r.name.scope, 0) + 1
    scopes = ", ".join(f"{n} {scope}" for scope, n in sorted(by_scope.items()))
    return (f"{len(results)} entries: {len(results) - len(failed)} hold, {len(failed)} fail"
            + (f" ({scopes})" if scopes else ""))


def line(result: Result) -> str:
    e = result.name
    flags = "".join(f" [{flag}]" for flag, on in (("guarded", e.guarded), ("public", e.public)) if on)
    scope = "" if e.scope == "runtime" else f" [{e.scope} only]"
    return f"FAIL {e.key}: {result.reason}  (used in {e.used_in}){scope}{flags}"


def report_recorded(results: list[Result], subject: str, path: Path) -> int:
    """A record writer's report (``record``, ``ascend``): each failing entry, the summary of
    ``subject``'s record written to ``path``; the exit status (1 when any entry fails)."""
    for result in results:
        if not result.ok:
            print(line(result))
    print(f"{subject}: {summary(results)}; recorded in {path}")
    return 1 if any(not r.ok for r in results) else 0


def source_version(root: Path) -> str | None:
    """The version an unpacked vLLM tree names (``vllm/_version.py``)."""
    tree = SourceResolver(root).tree("vllm._version")
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__"
                                                for t in node.targets):
            for value in ast.walk(node.value):
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    return value.value
    return None


def results_record(results: list[Result], version: str | None, checked: str, wheel: dict | None) -> dict:
    """One check's outcome as JSON (``wheel``: the file and sha256 the checked source came from)."""
    record = {
        "vllm_version": version,
        "checked": checked,
        "summary": summary(results),
        "failed": [r.name.key for r in results if not r.ok],
        "entries": [{"key": r.name.key, "kind": r.name.kind, "scope": r.name.scope, "used_in": r.name.used_in,
                     "ok": r.ok, "reason": r.reason} for r in results],
    }
    if wheel is not None:
        record["wheel"] = wheel
    return record


def wheel_of(path: Path) -> dict:
    return {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _release(version: str | None) -> str | None:
    """The admitted release ``version`` belongs to (its entries are checked), or None (all entries)."""
    try:
        found = release_of(version or "")
    except UnsupportedVLLM:  # no version to read (a tree without vllm/_version.py)
        return None
    return found if found in RELEASES else None


def targets(source: Path | None, wheel: Path | None) -> list[tuple[object, str | None, str, dict | None]]:
    """(resolver, vLLM version, what was checked, wheel) of each check to run: ``source`` alone, else
    the installed vLLM (if any) and the record of every other admitted release."""
    if source is not None:
        return [(SourceResolver(source), source_version(source), f"source tree (ast): {source}",
                 wheel_of(wheel) if wheel else None)]
    found = []
    try:
        installed = ImportResolver()
    except ImportError:
        installed = None
        print("vLLM is not installed here: only the recorded releases are checked")
    else:
        found.append((installed, installed.version, "installed (import + inspect)", None))
    for version in recorded_versions():
        if _release(version) is None or (installed is not None and _release(version) == _release(installed.version)):
            continue
        recorded = RecordResolver(record_path(version))
        found.append((recorded, version, recorded.label, recorded.wheel))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphchunk.contract.check",
                                     description="Check graphchunk's vLLM contract (graphchunk/contract/names.py) "
                                                 "against the installed vLLM and the recorded source of every "
                                                 "other admitted release (graphchunk/contract/records/).")
    parser.add_argument("--source", type=Path, help="a vLLM source tree (DIR/vllm/...), read with ast only, "
                                                    "checked instead")
    parser.add_argument("--scope", default="runtime,test,perf",
                        help="comma-separated scopes to check (runtime, test, perf; default all)")
    parser.add_argument("--results", type=Path, help="write the outcome as JSON here")
    parser.add_argument("--wheel", type=Path, help="the wheel --source was unpacked from (recorded with "
                                                   "its sha256 in --results)")
    parser.add_argument("--note", help="a free-text verdict recorded in --results")
    parser.add_argument("-v", "--verbose", action="store_true", help="also list passing entries with notes")
    args = parser.parse_args(argv)
    scopes = set(args.scope.split(","))
    names = tuple(e for e in NAMES if e.scope in scopes)
    if args.source and not (args.source / "vllm" / "__init__.py").is_file():
        parser.error(f"{args.source} has no vllm/__init__.py")
    checks, failed = [], False
    for resolver, version, checked, wheel in targets(args.source, args.wheel):
        results = check(resolver, names, release=_release(version))
        for result in results:
            if not result.ok:
                print(line(result))
            elif args.verbose and result.reason:
                print(f"ok   {result.name.key}: {result.reason}")
        print(f"vLLM {version}, {checked}: {summary(results)}")
        checks.append(results_record(results, version, checked, wheel))
        failed = failed or any(not r.ok for r in results)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        given = list(argv if argv is not None else sys.argv[1:])
        if "--note" in given:  # the verdict is recorded on its own
            at = given.index("--note")
            del given[at:at + 2]
        given = [arg for arg in given if not arg.startswith("--note=")]
        record = {"date": datetime.date.today().isoformat(), "admitted": list(RELEASES), "checks": checks,
                  "command": shlex.join(["python", "-m", "graphchunk.contract.check", *given])}
        if args.note:
            record["note"] = args.note
        args.results.write_text(json.dumps(record, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
