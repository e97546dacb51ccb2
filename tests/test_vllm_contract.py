"""graphchunk's contract with vLLM (``graphchunk/contract/names.py``), checked by
``graphchunk.contract.check``: every entry holds against the installed vLLM, the
checker reports what breaks (import + inspect, and ast on a source tree), every vLLM import in
graphchunk/ has an entry, and the recorded check of the next vLLM release covers every entry.
No engine is started and nothing is downloaded."""
from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

from graphchunk.contract import check
from graphchunk.contract.installed import ImportResolver
from graphchunk.contract.names import KINDS, NAMES, SCOPES, Name
from graphchunk.contract.source import SourceResolver

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "perf" / "results" / "vllm_contract.json"
NEXT_VLLM = "0.33.0"
"""The vLLM release whose source the recorded check (``RESULTS``) read."""


def test_entries_are_unique_and_name_graphchunks_files():
    keys = [entry.key for entry in NAMES]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    for entry in NAMES:
        assert entry.kind in KINDS and entry.scope in SCOPES, entry
        assert entry.module == "vllm" or entry.module.startswith("vllm."), entry
        for path in entry.used_in.split(", "):
            assert (REPO / path).is_file(), f"{entry.key}: used_in names {path}, which does not exist"
        if entry.kind in ("override", "patch", "hook"):
            assert entry.params is not None and "." in entry.qualname, entry


def test_every_entry_holds_against_the_installed_vllm():
    """If this fails, graphchunk's inventory of the vLLM it is installed with is wrong (or vLLM
    changed under it): fix the entry, or the code that relies on the name."""
    pytest.importorskip("vllm")
    results = check.check(ImportResolver())
    failed = [check.line(r) for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def test_a_missing_method_is_reported_by_both_checkers():
    pytest.importorskip("vllm")
    import vllm

    entries = (
        Name("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.no_such_hook", "override", "x", params=()),
        Name("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", "override", "x",
             params=("scheduler_output",)),
        Name("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.no_such_state", "attribute", "x"),
        Name("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs", "override", "x",
             params=("scheduler_output", "num_scheduled_tokens"), callers=("vllm.v1.worker.gpu_worker:Worker",)),
        Name("vllm.v1.attention.backend", "CommonAttentionMetadata", "call", "x", params=("query_start_loc",)),
    )
    installed_source = Path(vllm.__file__).resolve().parent.parent
    for resolver in (ImportResolver(), SourceResolver(installed_source)):
        results = check.check(resolver, entries)
        reasons = [r.reason for r in results]
        assert not any(r.ok for r in results), (resolver.label, reasons)
        assert "has no method no_such_hook" in reasons[0]
        assert "signature is (scheduler_output, intermediate_tensors)" in reasons[1]
        assert "has no attribute no_such_state" in reasons[2]
        assert "no longer called in vllm.v1.worker.gpu_worker:Worker" in reasons[3]
        assert "now requires query_start_loc_cpu" in reasons[4]


FAKE_VLLM = {
    "vllm/__init__.py": """
        import typing
        MODULE_ATTRS = {"Thing": ".things:Thing"}
        if typing.TYPE_CHECKING:
            from vllm.things import Thing
        else:
            def __getattr__(name):
                raise AttributeError(name)
        """,
    "vllm/things.py": """
        from dataclasses import dataclass, field
        from typing import ClassVar

        from .base import *

        __all__ = ["Thing", "Runner"]

        @dataclass
        class Thing:
            LIMIT: ClassVar[int] = 3
            size: int
            tags: list = field(default_factory=list)
            hidden: int = field(default=0, init=False)

        class Runner(Base):
            def __init__(self, config, device):
                self.config = config
                self.device, self.positions = device, None

            def step(self, output, tensors=None):
                return self._prepare(output)

            def _prepare(self, output, *, eager=False):
                pass
        """,
    "vllm/base.py": """
        class Base:
            name: str

            def execute(self, output, *args, **kwargs):
                self.state = 1
        """,
    "vllm/elsewhere.py": """
        class Moved:
            def __init__(self):
                self.level = 0
        """,
}


def test_the_source_checker_on_a_small_fake_tree(tmp_path):
    """ast only: the fake tree is never imported."""
    for path, text in FAKE_VLLM.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    m = "vllm.things"
    holds = (
        Name("vllm", "Thing", "import", "x"),                                    # via TYPE_CHECKING re-export
        Name(m, "Base", "subclass", "x"),                                         # via a star import
        Name(m, "Runner.step", "override", "x", params=("output", "tensors")),
        Name(m, "Runner._prepare", "patch", "x", params=("output", "*", "..."), callers=(f"{m}:Runner",)),
        Name(m, "Runner.execute", "override", "x", params=("output", "...")),    # defined in the base
        Name(m, "Runner.positions", "attribute", "x"),                            # self.a, self.b = ...
        Name(m, "Runner.state", "attribute", "x"),                                # assigned in the base
        Name(m, "Runner.name", "attribute", "x"),                                 # annotated in the base
        Name(m, "Runner", "call", "x", params=("config", "device")),
        Name(m, "Thing", "call", "x", params=("size",)),                          # the dataclass __init__
        Name(m, "Thing.tags", "field", "x"),
        Name(m, "Thing.LIMIT", "attribute", "x"),
        Name(m, "Moved.level", "attribute", "x"),                                 # moved: found elsewhere
        Name(m, "Runner", "literal", "x"),
    )
    breaks = {
        Name(m, "Runner.missing", "override", "x", params=()): "Runner has no method missing",
        Name(m, "Runner.step", "override", "x", params=("output",)): "signature is (output, tensors)",
        Name(m, "Runner.execute", "override", "x", params=("output", "tensors", "...")): "starts (output, tensors",
        Name(m, "Runner.execute", "patch", "x", params=("output", "*", "...")): "then keyword-only",
        Name(m, "Runner._prepare", "override", "x", callers=(f"{m}:Thing",)): "no longer called in vllm.things:Thing",
        Name(m, "Runner.level", "attribute", "x"): "Runner has no attribute level",
        Name(m, "Runner", "call", "x", params=("config",)): "now requires device",
        Name(m, "Thing", "call", "x", params=("size", "hidden")): "has no parameter hidden",
        Name(m, "Runner.device", "field", "x"): "not a dataclass-like class",
        Name(m, "Thing.colour", "field", "x"): "Thing has no field colour",
        Name("vllm.gone", "Thing", "import", "x"): "module vllm.gone not found (a Thing is defined in vllm.things)",
        Name("vllm", "Runner", "import", "x"): "vllm has no name Runner",
        Name(m, "Thing", "subclass", "x"): None,
        Name(m, "nowhere", "literal", "x"): "no string 'nowhere'",
    }
    resolver = SourceResolver(tmp_path)
    for result in check.check(resolver, holds):
        assert result.ok, (result.name.key, result.reason)
    assert "found in vllm.elsewhere" in check.check_entry(holds[-2], resolver).reason
    for entry, reason in breaks.items():
        result = check.check_entry(entry, resolver)
        if reason is None:  # a dataclass is a class: subclassing it holds
            assert result.ok, (entry.key, result.reason)
            continue
        assert not result.ok and reason in result.reason, (entry.key, result.reason)


def test_the_check_command_exits_1_and_names_what_broke(tmp_path, capsys):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '9.9.9'\n")
    out = tmp_path / "results.json"
    assert check.main(["--source", str(tmp_path), "--scope", "runtime", "--results", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "FAIL subclass vllm.v1.worker.gpu_model_runner:GPUModelRunner: module vllm.v1.worker.gpu_model_runner " \
           "not found" in printed
    runtime = [entry for entry in NAMES if entry.scope == "runtime"]
    assert f"vLLM 9.9.9, source tree (ast): {tmp_path}: {len(runtime)} entries: " in printed
    record = json.loads(out.read_text())
    assert record["vllm_version"] == "9.9.9" and len(record["entries"]) == len(runtime)


def _vllm_imports(root: Path):
    """(file, module, name) of every ``from vllm... import name`` (name None: ``import vllm...``)."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "vllm":
                yield from ((path, node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                yield from ((path, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "vllm")


def test_every_vllm_import_in_graphchunk_has_an_entry():
    modules = {entry.module for entry in NAMES if entry.kind == "module"}
    names = {(entry.module, entry.qualname) for entry in NAMES if entry.kind in ("import", "subclass", "classname")}
    missing = []
    for path, module, name in _vllm_imports(REPO / "graphchunk"):
        if name is not None:
            covered = (module, name) in names or f"{module}.{name}" in modules
        else:
            covered = module in modules or tuple(module.rsplit(".", 1)) in names
        if not covered:
            missing.append(f"{path.relative_to(REPO)}: {module} {name or ''}")
    assert not missing, "vLLM imports without an entry in graphchunk/contract/names.py:\n" + "\n".join(missing)


def test_the_recorded_check_of_the_next_vllm_covers_every_entry():
    """perf/results/vllm_contract.json: the checker run on vLLM's next release, unpacked from its
    wheel (``--source``). An entry added since must be checked there too: rerun it (see the file's
    ``command``)."""
    record = json.loads(RESULTS.read_text())
    assert record["vllm_version"] == NEXT_VLLM
    assert record["wheel"]["file"].startswith(f"vllm-{NEXT_VLLM}-") and len(record["wheel"]["sha256"]) == 64
    assert record["checked"].startswith("source tree (ast)")
    recorded = {entry["key"]: entry for entry in record["entries"]}
    assert set(recorded) == {entry.key for entry in NAMES}, "rerun the check: the contract's entries changed"
    assert all(entry["ok"] or entry["reason"] for entry in recorded.values())
    assert record["failed"] == [key for key, entry in recorded.items() if not entry["ok"]]
