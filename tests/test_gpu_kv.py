"""CI-sized run of ``perf/gpu/gpu_kv.py`` (``--quick``, CPU): the GPU harness of graphchunk's KV code
works end to end without vLLM, and its checks can fail.

One subprocess runs it as a lent GPU machine would, but with ``vllm`` unimportable
(``sys.modules['vllm'] = None``): it must exit 0 with every check passed in its JSON, which names
the device and all six layouts. In process: a copy that corrupts one element fails the copy
checks and the exit status; the caches it allocates are vLLM's own allocation's (shape, strides,
offsets, for every ``KVCacheLayout``) and its write reference is ``tests/gpu_style.py``'s. Timings
are not asserted.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

from perf.gpu import gpu_kv

LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
CHECKS = {"write", "probe", "blocks"} | {f"{path}/{op}" for path in ("strided", "indexed", "gather")
                                         for op in ("copy", "temperature", "rotated", "read_keys")}
WITHOUT_VLLM = ("import runpy, sys; sys.modules['vllm'] = sys.modules['xxhash'] = None; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
"""As on a lent GPU machine: neither vLLM nor xxhash importable."""


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_kv") / "gpu_kv.json"
    proc = subprocess.run([sys.executable, "-c", WITHOUT_VLLM, str(REPO / "perf/gpu/gpu_kv.py"), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    print(proc.stdout, proc.stderr)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_quick_run_without_vllm_passes_every_check(quick):
    proc, result = quick
    assert proc.returncode == 0, proc.stderr
    assert result["passed"] and result["failed"] == []
    assert result["device_type"] == "cpu" and result["device"] == gpu_kv.device_name(torch.device("cpu"))
    assert result["device"] and result["torch"] == torch.__version__ and result["dtype"] == "float32"
    assert result["key_hash"].startswith("hashlib")
    assert list(result["layouts"]) == LAYOUTS
    for layout, out in result["layouts"].items():
        assert set(out["checks"]) == CHECKS and all(out["checks"].values()), layout
        assert out["strided_path"], f"{layout}: vLLM's layouts are affine, copies take the strided path"
        assert {k: v["gb_s"] > 0 for k, v in out["bandwidth"].items()} == \
            {f"{p}/{o}": True for p in ("strided", "indexed", "gather") for o in ("copy", "temperature", "rotated")}
    assert result["torch_copy"]["gb_s"] > 0
    plan = result["plan"]
    assert (plan["requests"], plan["chunks"]) == (8, 64) and all(plan["checks"].values())
    assert plan["cold_ms"] > 0 and plan["warm_ms"] > 0
    assert "torch copy" in proc.stdout and "all checks passed" in proc.stdout


def test_a_corrupted_copy_fails_its_checks_and_the_exit_status(tmp_path, monkeypatch):
    """One element off after every ``copy_slots`` (and so ``copy_blocks``): those checks fail in
    every layout, the others still pass, and the run exits 1."""
    original = gpu_kv.KVCopier.copy_slots

    def corrupting(self, src, dst, key_temperature=1.0):
        original(self, src, dst, key_temperature)
        bs = self.slot_map.block_size
        self.caches[0][dst[0] // bs, 0, dst[0] % bs, 0] += 1

    monkeypatch.setattr(gpu_kv.KVCopier, "copy_slots", corrupting)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # main's, for this process's later tests
    out = tmp_path / "gpu_kv.json"
    assert gpu_kv.main(["--quick", "--repeats", "1", "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert not result["passed"]
    paths = ("strided", "indexed", "gather")
    broken = {f"{path}/{op}" for path in paths for op in ("copy", "temperature")} | {"blocks"}
    for layout in LAYOUTS:
        checks = result["layouts"][layout]["checks"]
        assert {name for name, ok in checks.items() if not ok} == broken, layout
    assert set(result["failed"]) == {f"{layout}/{name}" for layout in LAYOUTS for name in broken}


def test_caches_and_write_are_vllms():
    """perf's caches are what vLLM's worker allocates (``gpu_style.vllm_caches``: vLLM's own code),
    and its write reference writes what ``gpu_style``'s does."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    import gpu_style

    assert {x.name: x.value for x in KVCacheLayout} == gpu_kv.LAYOUTS
    sizes, blocks = gpu_kv.Sizes(layers=3, heads=2, head_size=32, block_size=16, copy_tokens=2), 5
    slots = torch.tensor([0, 17, 4 * 16 + 15, -1, 33])
    key, value = torch.randn(5, 2, 32).to(torch.bfloat16), torch.randn(5, 2, 32).to(torch.bfloat16)
    for layout in KVCacheLayout:
        theirs = gpu_style.vllm_caches(layout, torch.bfloat16, blocks, 16, 2, 32, 3)
        ours = gpu_kv.vllm_caches(layout.name, sizes, blocks, torch.bfloat16, "cpu")
        assert [(c.shape, c.stride(), c.storage_offset()) for c in ours] == \
               [(c.shape, c.stride(), c.storage_offset()) for c in theirs], layout.name
        gpu_style.write_flash(key, value, theirs[1], slots)
        gpu_kv.write_flash(key, value, ours[1], slots)
        assert torch.equal(ours[1], theirs[1]) and bool(ours[1].any()), layout.name
