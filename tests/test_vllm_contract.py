"""graphchunk's contract with vLLM (``graphchunk/contract/names.py``), checked by
``graphchunk.contract.check``: every entry holds against the installed vLLM and against the
recorded source of every other admitted release (``graphchunk/contract/records/``), the admitted
releases are the ``cuda`` extra's and each has its branch of every moved name
(``graphchunk/compat.py``), the checker reports what breaks (import + inspect, ast on a source
tree, a record), and every vLLM import in graphchunk/ has an entry. No engine is started and
nothing is downloaded."""
from __future__ import annotations

import ast
import json
import re
import textwrap
import tomllib
from pathlib import Path

import pytest

from graphchunk import compat
from graphchunk.contract import check, names
from graphchunk.contract.installed import ImportResolver
from graphchunk.contract.names import KINDS, NAMES, SCOPES, Name
from graphchunk.contract.record import RecordingResolver, RecordResolver, record_path, recorded_versions
from graphchunk.contract.source import SourceResolver

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "perf" / "results" / "vllm_contract.json"


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
    resolver = ImportResolver()
    results = check.check(resolver, release=compat.release(resolver.version))
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
    runtime = [entry for entry in NAMES if entry.scope == "runtime"]  # 9.9 is no admitted release: all entries
    assert f"vLLM 9.9.9, source tree (ast): {tmp_path}: {len(runtime)} entries: " in printed
    [record] = json.loads(out.read_text())["checks"]
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


def _admitted_by_the_cuda_extra() -> tuple[str, ...]:
    """The vLLM releases (major.minor) ``pip install 'graphchunk[cuda]'`` may install."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    [spec] = [Requirement(r).specifier for r in extra if Requirement(r).name == "vllm"]
    return tuple(f"0.{minor}" for minor in range(0, 100) if spec.contains(Version(f"0.{minor}.0")))


def test_the_admitted_releases_are_the_cuda_extras_and_each_has_every_branch():
    """Removing a release's branch of a moved name (or a release from ``RELEASES``) while the
    ``cuda`` extra still admits that release fails here."""
    assert compat.RELEASES == _admitted_by_the_cuda_extra()
    for name, places in compat.MOVED.items():
        assert set(places) == set(compat.RELEASES), f"compat.MOVED[{name!r}] has no branch for " \
                                                    f"{sorted(set(compat.RELEASES) - set(places))}"
        for release in compat.RELEASES:  # the contract checks each place in its own release
            assert [e.module for e in NAMES if e.qualname == name and e.kind == "import"
                    and e.applies_to(release)] == [places[release]]


def test_every_admitted_release_is_checked_and_holds():
    """The installed vLLM by import, every other admitted release from its record (read from its
    wheel, sha256 kept): every entry for that release holds. An entry added since a record was
    written fails here, naming the command that regenerates the record."""
    pytest.importorskip("vllm")
    installed = compat.release()
    recorded = {compat.release_of(v): v for v in recorded_versions()}
    assert set(compat.RELEASES) <= set(recorded) | {installed}, "an admitted release has neither record nor install"
    for release, version in recorded.items():
        if release == installed:
            continue
        resolver = RecordResolver(record_path(version))
        assert resolver.wheel["file"].startswith(f"vllm-{version}-") and len(resolver.wheel["sha256"]) == 64
        failed = [check.line(r) for r in check.check(resolver, release=release) if not r.ok]
        assert not failed, "\n".join(failed)


@pytest.mark.parametrize("version", ["0.34.0", "0.34.1+cu130", "0.35.0", "1.0.0"])
def test_a_vllm_without_model_runner_v1_is_refused_saying_so(version):
    """vLLM 0.34 removed Model Runner V1 (its wheel has no vllm/v1/worker/gpu_model_runner.py nor
    cpu_model_runner.py), the runner graphchunk's extends: 0.34 and later are refused naming that."""
    with pytest.raises(compat.UnsupportedVLLM, match=rf"^graphchunk supports vLLM 0.32 and 0.33; this is vLLM "
                                                     rf"{re.escape(version)}, which has no Model Runner V1"):
        compat.release(version)


def test_the_admitted_releases_pass_and_an_older_one_is_refused_without_the_runner_reason():
    assert [compat.release(v) for v in ("0.32.0", "0.33.0", "0.33.1+cu130")] == ["0.32", "0.33", "0.33"]
    with pytest.raises(compat.UnsupportedVLLM) as refused:
        compat.release("0.31.2")
    assert "this is vLLM 0.31.2: install a supported release" in str(refused.value)


def test_the_plugin_installs_nothing_under_a_refused_vllm(monkeypatch, caplog):
    """vLLM calls general plugins unguarded in every process, and 0.34's VllmConfig lacks what the
    plugin wraps: under a refused release the plugin wraps nothing and logs why (under an admitted
    one the same call wraps process_inputs)."""
    pytest.importorskip("vllm")
    import logging

    import vllm
    from vllm.v1.engine.input_processor import InputProcessor

    from graphchunk.engine import plugin

    def process_inputs(self, *args, **kwargs):
        return None

    monkeypatch.setattr(InputProcessor, "process_inputs", process_inputs)
    installed = vllm.__version__
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level(logging.WARNING, logger="vllm.graphchunk"):
        plugin.register()
    assert InputProcessor.process_inputs is process_inputs
    assert "graphchunk's plugin installs nothing: graphchunk supports vLLM 0.32 and 0.33; this is vLLM 0.34.0, " \
           "which has no Model Runner V1" in caplog.text
    monkeypatch.setattr(vllm, "__version__", installed)
    plugin.register()
    assert InputProcessor.process_inputs is not process_inputs


def test_a_branch_removed_fails_against_its_release(monkeypatch):
    """If the 0.33 branch of a moved name were dropped (0.33 using 0.32's place), the check of the
    0.33 record says so."""
    later = compat.RELEASES[-1]
    version = {compat.release_of(v): v for v in recorded_versions()}[later]
    moved = {name: dict(places) for name, places in compat.MOVED.items()}
    moved["is_quantized_kv_cache"][later] = moved["is_quantized_kv_cache"][compat.RELEASES[0]]
    monkeypatch.setattr(names, "MOVED", moved)
    entries = [e for e in names._entries() if e.qualname == "is_quantized_kv_cache"]
    results = check.check(RecordResolver(record_path(version)), tuple(entries), release=later)
    assert results and not any(r.ok for r in results)
    assert all("regenerate it: python -m graphchunk.contract.record" in r.reason
               or "has no name is_quantized_kv_cache" in r.reason for r in results), [r.reason for r in results]


def test_a_record_answers_as_the_source_it_was_read_from(tmp_path):
    """The fake tree checked through a recording, then from the record alone: the same outcome for
    every entry, and an entry the record never saw fails naming the regenerating command."""
    for path, text in FAKE_VLLM.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    m = "vllm.things"
    entries = (
        Name(m, "Runner.step", "override", "x", params=("output", "tensors")),
        Name(m, "Runner.step", "override", "y", params=("output",)),
        Name(m, "Runner.execute", "override", "x", params=("output", "...")),
        Name(m, "Runner.state", "attribute", "x"),
        Name(m, "Runner.level", "attribute", "x"),
        Name(m, "Thing", "call", "x", params=("size", "hidden")),
        Name(m, "Thing.tags", "field", "x"),
        Name(m, "Moved.level", "attribute", "x"),
        Name("vllm.gone", "Thing", "import", "x"),
        Name(m, "Runner._prepare", "patch", "x", params=("output", "*", "..."), callers=(f"{m}:Runner",)),
    )
    recording = RecordingResolver(tmp_path)
    live = [(r.ok, r.reason) for r in check.check(recording, entries)]
    assert [ok for ok, _ in live] == [True, False, True, True, False, False, True, True, False, True]
    saved = tmp_path / "record.json"
    saved.write_text(json.dumps({"vllm_version": "0.33.0", "wheel": {"file": "w", "sha256": "0" * 64},
                                 "objects": recording.objects, "answers": recording.answers}))
    replayed = RecordResolver(saved)
    assert [(r.ok, r.reason) for r in check.check(replayed, entries)] == live
    unseen = check.check_entry(Name(m, "Runner.device", "attribute", "x"), replayed)
    assert not unseen.ok and "regenerate it: python -m graphchunk.contract.record 0.33.0" in unseen.reason


def test_the_recorded_results_cover_every_admitted_release():
    """perf/results/vllm_contract.json: the check command's record (every admitted release)."""
    record = json.loads(RESULTS.read_text())
    assert record["admitted"] == list(compat.RELEASES)
    checked = {compat.release_of(c["vllm_version"]): c for c in record["checks"]}
    assert set(checked) == set(compat.RELEASES)
    for release, found in checked.items():
        assert {e["key"] for e in found["entries"]} == {e.key for e in NAMES if e.applies_to(release)}, \
            "rerun the check: the contract's entries changed (see the file's command)"
        assert found["failed"] == [e["key"] for e in found["entries"] if not e["ok"]]


def test_the_render_wrapper_passes_on_what_vllm_033_added(monkeypatch):
    """vLLM 0.33's ``ServingRender.render_chat_request`` gained ``engine_chat_template_kwargs``:
    graphchunk's wrapper (document_hooks) forwards it, and still runs on 0.32's signature."""
    pytest.importorskip("vllm")
    import asyncio

    from vllm.entrypoints.scale_out.render.serving import ServingRender

    from graphchunk.engine import document_hooks

    seen = []

    async def render_033(self, request, raw_request=None, engine_chat_template_kwargs=None):
        seen.append((request, raw_request, engine_chat_template_kwargs))
        return None

    monkeypatch.setattr(ServingRender, "render_chat_request", render_033)
    document_hooks._carry_into_render_endpoint()
    kwargs_hook = dict
    asyncio.run(ServingRender.render_chat_request(object(), "req", None, engine_chat_template_kwargs=kwargs_hook))
    asyncio.run(ServingRender.render_chat_request(object(), "req"))
    assert seen == [("req", None, kwargs_hook), ("req", None, None)]
