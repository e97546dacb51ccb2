"""``graphchunk-warmup`` end to end (``python -m graphchunk.tools.warmup``) on a tiny checkpoint."""
import json
import subprocess
import sys

import pytest

from graphchunk.reference import models

TINY_GRID = """
backend = "compile"
[grid]
batch = [1]
num_chunks = [4]
max_chunk_len = [64]
max_sys_len = [32]
question_tokens = [8, 16]
"""


def warmup(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "graphchunk.tools.warmup", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_warmup_captures_every_bucket_and_writes_a_manifest(tmp_path):
    grid = tmp_path / "tiny.toml"
    grid.write_text(TINY_GRID)
    manifest_path = tmp_path / "manifest.json"
    model = str(models.tiny_checkpoint("llama3"))
    done = warmup("--templates", str(grid), "--model", model, "--dtype", "float32", "--max-model-len", "1024",
                  "--manifest", str(manifest_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "graphchunk: capturing compile templates" in done.stderr and "2/2" in done.stderr  # progress bar
    manifest = json.loads(manifest_path.read_text())
    assert (manifest["backend"], manifest["model"], manifest["dtype"]) == ("compile", model, "torch.float32")
    assert [(row["bucket"], row["num_tokens"]) for row in manifest["buckets"]] == [
        ("b1-c4x64-s32-q8", 8), ("b1-c4x64-s32-q16", 16)]
    assert all(row["seconds"] > 0 and row["replayed"] == row["padded"] == 0 for row in manifest["buckets"])
    assert "captured 2 templates" in done.stdout and "b1-c4x64-s32-q16" in done.stdout
    # as the server runs: vLLM's own compilation stays on next to graphchunk's templates
    assert manifest["captured_by"] == "graphchunk" and manifest["vllm_graphs"]["compilation_mode"] == "DYNAMO_TRACE_ONCE"
    assert "vLLM: compilation DYNAMO_TRACE_ONCE" in done.stdout


def test_warmup_refuses_a_bad_grid_before_starting_an_engine(tmp_path):
    grid = tmp_path / "bad.toml"
    grid.write_text(TINY_GRID.replace('"compile"', '"tensorrt"'))
    done = warmup("--templates", str(grid), timeout=120)
    assert done.returncode == 2
    assert "graphchunk-warmup: error:" in done.stderr and "bad.toml" in done.stderr and "tensorrt" in done.stderr
    assert "Traceback" not in done.stderr
