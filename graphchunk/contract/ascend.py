"""graphchunk's contract with vllm-ascend: the vllm-ascend names its Ascend code relies on, and a
record of what vllm-ascend's source answered about them.

graphchunk refuses Ascend at start-up (``engine/worker.py``, ``ascend_refusal``); what it has for
Ascend was written against vllm-ascend's own source at one commit (``COMMIT``, main of 2026-08-22,
paired upstream with vLLM 0.27.1; no vllm-ascend release pairs with a vLLM graphchunk admits):
the runner's hooks and its one-argument ``initialize_kv_cache`` (``engine/model_runner.py``), the
``(k_cache, v_cache)`` layout and the write op that keeps the first caches it is handed
(``engine/kv_binding.py``, ``cache/kv_slots.py``), and the names the refusal says graphchunk's chunk
forwards lack. ``NAMES`` lists them as ``names.Name`` entries (kinds as there); the checker is
``graphchunk.contract.check``'s, its answers recorded by ``record.RecordingResolver`` from a
checkout of that commit and read back by ``AscendRecordResolver``:

    git --git-dir=VLLM_ASCEND.git archive COMMIT vllm_ascend | tar -x -C /tmp/vllm-ascend
    python -m graphchunk.contract.ascend /tmp/vllm-ascend    # writes records/vllm_ascend-COMMIT8.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from graphchunk.contract.names import Name
from graphchunk.contract.record import RECORDS, RecordResolver, RecordingResolver

COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"
"""vllm-ascend main, 2026-08-22 ("[Test] add memcache dsv4-flash weekly case (#14760)")."""
PAIRED_VLLM = "0.27.1"

MR = "graphchunk/engine/model_runner.py"
WK = "graphchunk/engine/worker.py"
KB = "graphchunk/engine/kv_binding.py"
RUNNER = "vllm_ascend.worker.model_runner_v1"
ATTN = "vllm_ascend.attention.attention_v1"

NAMES: tuple[Name, ...] = (
    Name("vllm_ascend.worker.worker", "NPUWorker", "subclass", WK,
         "the worker Ascend's --worker-cls would extend (refused at start-up: ascend_refusal)"),
    Name(RUNNER, "NPUModelRunner", "subclass", MR, "its runner, swapped for the chunk-aware subclass"),
    Name(RUNNER, "NPUModelRunner.initialize_kv_cache", "override", MR,
         "one argument: graphchunk calls the base with what its signature takes (call_with_accepted)",
         params=("kv_cache_config",), callers=("vllm_ascend.worker.worker:NPUWorker",)),
    Name(RUNNER, "NPUModelRunner.execute_model", "override", MR,
         params=("scheduler_output", "intermediate_tensors")),
    Name(RUNNER, "NPUModelRunner._prepare_inputs", "override", MR,
         params=("scheduler_output", "num_scheduled_tokens"), callers=(f"{RUNNER}:NPUModelRunner",)),
    Name(RUNNER, "NPUModelRunner._determine_batch_execution_and_padding", "override", MR,
         params=("num_tokens", "...")),
    Name(ATTN, "AscendAttentionBackendImpl.do_kv_cache_update", "call", KB,
         "the layer's KV-write op, on a (k_cache, v_cache) pair (kv_binding.backend_write)",
         params=("layer", "key", "value", "kv_cache", "slot_mapping")),
    Name(ATTN, "AscendAttentionBackendImpl.key_cache", "attribute", KB,
         "the K cache the write op keeps from its first call: nothing is probed through it on a scratch"),
    Name("vllm_ascend.attention.utils", "AscendCommonAttentionMetadata.attn_state", "field", WK,
         "what a chunk forward's metadata would need (named in ascend_refusal)"),
    Name("vllm_ascend.attention.utils", "AscendCommonAttentionMetadata.actual_seq_lengths_q", "field", WK,
         "as attn_state"),
    Name("vllm_ascend.ascend_forward_context", "set_ascend_forward_context", "import", WK,
         "a chunk forward's forward context (named in ascend_refusal)"),
    Name("vllm_ascend.ops.rotary_embedding", "update_cos_sin", "import", WK,
         "a chunk forward's rotary tables (named in ascend_refusal)"),
)

RECORD = RECORDS / f"vllm_ascend-{COMMIT[:8]}.json"


class AscendRecordResolver(RecordResolver):
    """The checker's questions answered from ``RECORD`` (a record of vllm-ascend at ``COMMIT``)."""

    def __init__(self, path: Path = RECORD):
        super().__init__(path)

    def _describe(self, data: dict) -> None:
        self.commit: str = data["commit"]
        self.version = f"vllm-ascend@{self.commit[:8]}"
        self.label = f"recorded source of vllm-ascend {self.commit} ({self.path.name})"
        self.subject = f"vllm-ascend {self.commit[:8]}"
        self.regenerate = "python -m graphchunk.contract.ascend CHECKOUT"


def write_record(root: Path, commit: str = COMMIT) -> tuple[Path, list]:
    """Checks ``NAMES`` against the checkout at ``root`` (``root/vllm_ascend/...``), writing down each answer."""
    from graphchunk.contract import check

    resolver = RecordingResolver(root)
    results = check.check(resolver, NAMES)
    record = {"commit": commit, "paired_vllm": PAIRED_VLLM, "date": datetime.date.today().isoformat(),
              "command": "python -m graphchunk.contract.ascend CHECKOUT", "objects": resolver.objects,
              "answers": dict(sorted(resolver.answers.items()))}
    path = RECORDS / f"vllm_ascend-{commit[:8]}.json"
    path.write_text(json.dumps(record, indent=0) + "\n")
    return path, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphchunk.contract.ascend",
                                     description="Record vllm-ascend's answers to graphchunk's Ascend contract.")
    parser.add_argument("root", type=Path, help="a checkout of vllm-ascend (ROOT/vllm_ascend/...)")
    parser.add_argument("--commit", default=COMMIT, help="the commit checked out there")
    args = parser.parse_args(argv)
    from graphchunk.contract.check import report_recorded

    path, results = write_record(args.root, args.commit)
    return report_recorded(results, f"vllm-ascend {args.commit[:8]}", path)


if __name__ == "__main__":
    sys.exit(main())
