"""Whether a result file measured graphchunk as it is now.

A result records ``graphchunk_code`` (``harness.versions()``, its ``environment`` or ``versions``): ``code_digest()``, a
digest of every module under ``graphchunk/`` as Python reads it (its syntax tree, docstrings left
out), so a change to comments, docstrings or layout keeps it and any other change to the code
moves it. A result is **current** when its digest is today's, or when ``perf/freshness.json``
acknowledges every change since as leaving that result's numbers as they were:

    {"acknowledged": [{"from": DIGEST, "to": DIGEST, "groups": ["serving", ...], "why": "..."}],
     "pending": {"FILE.json": "why it is cited though not current, and what reruns it"}}

an entry says that results of ``groups`` (perf/'s folders: serving, answers, soak, ...) measured
on the code ``from`` still hold on the code ``to``, and why: a claim a reviewer reads in git.
``pending`` lists results the README may still cite while their rerun is owed; ``tests/
test_freshness.py`` fails on any other README citation that is not current, or whose checks failed.

    python -m perf.common.freshness                # each result's verdict, and today's digest
    python -m perf.common.freshness --ack GROUPS --from DIGEST --why TEXT   # record an acknowledgement
    python -m perf.common.freshness --backfill perf/results/X.json  # a result that recorded only its commit
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path

from perf.common.harness import REPO

CODE = REPO / "graphchunk"
ACKS = REPO / "perf" / "freshness.json"
RESULTS = REPO / "perf" / "results"


def _tree(source: str) -> str:
    """The module's syntax tree as text, without its string statements (docstrings, attribute
    docstrings: no-ops to Python)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                 and isinstance(s.value.value, str))] or [ast.Pass()]
    return ast.dump(tree)


def digest_of(sources: dict[str, str]) -> str:
    """``code_digest`` of modules given as {path relative to graphchunk/: source}."""
    h = hashlib.sha256()
    for path in sorted(sources):
        h.update(path.encode() + b"\0" + _tree(sources[path]).encode() + b"\0")
    return h.hexdigest()[:16]


def code_digest(root: Path = CODE) -> str:
    """The digest of graphchunk's code as it is in ``root`` now."""
    return digest_of({str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.py"))})


def digest_at(commit: str) -> str:
    """The digest of graphchunk's code at ``commit`` (from git: for results that recorded their
    commit, clean, before results recorded digests)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout

    paths = [p for p in git("ls-tree", "-r", "--name-only", commit, "graphchunk").split() if p.endswith(".py")]
    return digest_of({p.removeprefix("graphchunk/"): git("show", f"{commit}:{p}") for p in paths})


def backfill(path: Path) -> str:
    """Records in result ``path`` the digest of the commit it recorded (refused for a run whose
    graphchunk/ had uncommitted changes: its code is not in git)."""
    result = json.loads(path.read_text())
    env = result.get("environment") or result.get("versions")
    commit = env and env.get("graphchunk_commit")
    if not commit or env.get("graphchunk_dirty") is not False:
        raise ValueError(f"{path.name}: no clean commit recorded ({commit}, dirty {env and env.get('graphchunk_dirty')})")
    env["graphchunk_code"] = digest_at(commit)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return env["graphchunk_code"]


def recorded_digest(result: dict) -> str | None:
    """The digest a result recorded (``harness.versions()``, under ``environment`` or ``versions``)."""
    for key in ("environment", "versions"):
        if isinstance(result.get(key), dict) and result[key].get("graphchunk_code"):
            return result[key]["graphchunk_code"]
    return None


def load_acks(path: Path = ACKS) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"acknowledged": [], "pending": {}}


def holding(group: str, now: str, acks: dict) -> set[str]:
    """The digests whose ``group`` results hold on the code ``now``: itself, and every digest an
    acknowledged chain of changes leads from to it."""
    found, grew = {now}, True
    while grew:
        grew = False
        for ack in acks["acknowledged"]:
            if ack["to"] in found and ack["from"] not in found and group in ack["groups"]:
                found.add(ack["from"])
                grew = True
    return found


def verdict(result: dict, group: str, now: str, acks: dict) -> str:
    """'current', 'stale' (measured other code, no acknowledgement leads here) or 'unrecorded'."""
    measured = recorded_digest(result)
    if measured is None:
        return "unrecorded"
    return "current" if measured in holding(group, now, acks) else "stale"


def checks_passed(result: dict) -> bool | None:
    """The result's own verdict on its checks (None: it keeps none)."""
    for key in ("checks_passed", "passed"):
        if isinstance(result.get(key), bool):
            return result[key]
    checks = result.get("checks")
    if isinstance(checks, list) and checks and all(isinstance(c, dict) and "passed" in c for c in checks):
        return all(c["passed"] for c in checks)
    if isinstance(checks, dict) and any(isinstance(v, bool) for v in checks.values()):
        return all(v for v in checks.values() if isinstance(v, bool))  # None: a check the run could not make
    return None


def unfit_citations(page: str, found: list | None = None) -> list[str]:
    """The result files ``page`` cites (by name) that measured other code with no acknowledgement
    and no pending rerun, or whose own checks failed; ``found``: ``results_index.rows()``."""
    from perf.common import results_index

    bad = []
    for _, files, _, _, _, code in results_index.rows() if found is None else found:
        name = files[0]
        if not name.endswith(".json") or not re.search(rf"(?<![\w.-]){re.escape(name)}\b", page):
            continue
        if code not in ("current", "pending"):
            bad.append(f"{name}: {code}")
        elif code == "current" and checks_passed(json.loads((RESULTS / name).read_text())) is False:
            bad.append(f"{name}: its checks failed")
    return bad


def main(argv: list[str] | None = None) -> int:
    from perf.common import results_index

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ack", help="comma-separated groups whose results the change leaves as they were")
    parser.add_argument("--from", dest="start", help="the digest the results were measured on")
    parser.add_argument("--why", help="why the change leaves those numbers as they were")
    parser.add_argument("--backfill", nargs="+", type=Path, default=[],
                        help="result files to record the digest of their recorded (clean) commit in")
    args = parser.parse_args(argv)
    now, acks = code_digest(), load_acks()
    for path in args.backfill:
        print(f"{path.name}: {backfill(path)}")
    if args.backfill:
        return 0
    if args.ack:
        if not (args.start and args.why):
            parser.error("--ack needs --from and --why")
        acks["acknowledged"].append({"from": args.start, "to": now, "groups": args.ack.split(","), "why": args.why})
        ACKS.write_text(json.dumps(acks, indent=1) + "\n")
        print(f"acknowledged {args.start} -> {now} for {args.ack}")
        return 0
    print(f"graphchunk's code now: {now}")
    for group, files, _, _, pages, code in results_index.rows():
        if files[0].endswith(".json"):
            passed = checks_passed(json.loads((RESULTS / files[0]).read_text()))
            print(f"{files[0]:40} {group:8} {code:11} checks {passed!s:6} cited in {', '.join(pages) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
