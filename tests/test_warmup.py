"""``graphchunk-warmup`` end to end on a tiny checkpoint: its console script's process, started
ahead of this module (``engines``: vLLM's compile holds one core for about a minute); its
refusals in this process."""
import json
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

import engines
from graphchunk.reference import models
from inprocess import run_main

TINY_GRID = """
backend = "vllm"
[grid]
batch = [1]
num_chunks = [4]
max_chunk_len = [64]
max_sys_len = [32]
question_tokens = [8, 16]
"""


class Warmup(NamedTuple):
    done: subprocess.CompletedProcess
    grid: Path
    manifest: Path
    model: str


def build_warmup() -> Warmup:
    """``graphchunk-warmup`` on the tiny grid, its manifest in a new directory."""
    work = engines.scratch("warmup")
    grid, manifest = work / "tiny.toml", work / "manifest.json"
    grid.write_text(TINY_GRID)
    model = str(models.tiny_checkpoint("llama3"))
    done = engines.run_ahead("graphchunk.tools.warmup", ["--templates", str(grid), "--model", model, "--dtype",
                                                         "float32", "--max-model-len", "1024", "--manifest", str(manifest)])
    return Warmup(done, grid, manifest, model)


warmup = engines.fixture(build_warmup, "warmup")


@pytest.mark.slow
def test_warmup_starts_the_engine_on_the_grid_and_writes_a_manifest(warmup):
    done, grid, manifest_path, model = warmup
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads(manifest_path.read_text())
    assert (manifest["grid"], manifest["backend"], manifest["model"], manifest["dtype"]) == (
        str(grid), "vllm", model, "torch.float32")
    assert [row["bucket"] for row in manifest["buckets"]] == ["b1-c4x64-s32-q8", "b1-c4x64-s32-q16"]
    assert all(row["replayed"] == row["padded"] == row["eager"] == 0 for row in manifest["buckets"])
    assert manifest["outside_buckets"] == {"replayed": 0, "padded": 0, "eager": 0}
    # as the server runs: vLLM's own compilation on; on CPU one dynamic-shape graph, no capture sizes
    assert manifest["vllm_graphs"]["compilation_mode"] == "DYNAMO_TRACE_ONCE"
    assert "vLLM: compilation DYNAMO_TRACE_ONCE" in done.stdout
    assert "2 buckets, token counts [8, 16]; among vLLM's capture sizes: none" in done.stdout


@pytest.mark.parametrize("backend", ["tensorrt", "compile"])
def test_warmup_refuses_a_bad_grid_before_starting_an_engine(tmp_path, backend):
    """In this process (the refusal comes before any engine; an exception would fail the test)."""
    from graphchunk.tools import warmup as tool

    grid = tmp_path / "bad.toml"
    grid.write_text(TINY_GRID.replace('"vllm"', f'"{backend}"'))
    done = run_main(tool.main, ["--templates", str(grid)], ["graphchunk-warmup"])
    assert done.returncode == 2
    stderr = done.stderr
    assert "graphchunk-warmup: error:" in stderr and "bad.toml" in stderr
    assert f"backend '{backend}' is not supported: graphchunk's own graph templates were removed" in stderr
