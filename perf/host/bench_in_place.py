"""What sharing documents in place would buy at the sizing benchmark's binding budget, measured
through vLLM 0.32's own scheduler and KV cache manager with the change docs/architecture.md names
applied as a test-only patch (``perf/host/in_place.py``; issue 71, deliverable 3).

    .venv/bin/python -m perf.host.bench_in_place                  # ~1 min: run it alone
    .venv/bin/python -m perf.host.bench_in_place --quick          # smoke run, a few seconds

The traffic is the sizing run's (``perf/results/sizing.json``, docs/sizing.md): its corpus, its
two traces (cold, then warm on the same scheduler), its prompts as graphchunk's chat server places
them (SmolLM2's template), 16 tokens out (as ``--ignore-eos``), ``--concurrency`` requests
outstanding (a closed loop, as ``vllm bench serve --max-concurrency``), 192 blocks of 128 tokens,
vLLM's CPU server defaults (2048 batched tokens, 128 sequences). What differs between the kinds is
only where the documents' KV lives:

* ``vanilla``: every block is vLLM's; documents are prompt tokens, prefix-cached by vLLM;
* ``copy/pool=S``: graphchunk today: a share ``S`` of the blocks is the chunk pool, a request's
  documents are external tokens in its own fresh blocks;
* ``in_place/pool=S``: the documents' blocks are the pool's own, named in the request's block
  table (the patch), so vLLM allocates blocks only for the system prompt, the question and the
  output. Each entry (and the system prompt before them) is padded to whole blocks with a filler
  token (the padded prompt is what would run); a document the pool cannot hold (its blocks all
  named by running requests) is the request's own, as a copy.

No model runs: each scheduled request gets a token when its prompt is done, so what is measured is
vLLM's admission and block accounting, per step: requests running at once (``len(running)``, what
``vllm:num_requests_running`` reports), blocks of vLLM's they hold, pool blocks named in place,
preemptions, and the steps a pass takes (a GPU decode step costs about the same for 5 or 16
requests, DESIGN.md §10: fewer steps for the same requests is what a GPU would turn into
throughput; this CPU's compute-bound serving would not). Each pass ends with vLLM's accounting
checked: all its blocks free, no pool block held.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from types import SimpleNamespace

from perf.common import harness as H
from perf.common.vllm_scheduler import vllm_scheduler
from perf.host.in_place import Doc, Owner, in_place_patch

BLOCK = 128
SIZING = SimpleNamespace(docs_per_level=40, doc_tokens=(160, 220), questions=64, question_words=(6, 16),
                         num_prompts=[64], zipf=1.0, docs_per_prompt=5, seed=0)
"""The sizing run's traffic (perf/results/sizing.json's config)."""
BASE = "copy/pool=0.5"
"""What the steps are compared with: graphchunk today, at its default pool share. Not vanilla: a
document graphchunk computes runs in its chunk forward, outside vLLM's token budget, which this
scheduler-only run does not charge (the prompt tokens vLLM schedules are recorded per pass)."""
KINDS = ("vanilla", "copy/pool=0.25", "copy/pool=0.5", "in_place/pool=0.25", "in_place/pool=0.5",
         "in_place/pool=0.75")


def prompts(tokenizer, num_prompts: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Per pass ('cold', 'warm'): each request's prompt tokens and boundaries (each document's start
    and the question's), placed as graphchunk's chat server places them; the sizing run's traces at
    its 64 prompts a pass."""
    from graphchunk.documents import document_messages, hf_render, place_documents
    from perf.serving.serve_trace import build_levels

    args = SimpleNamespace(**{**vars(SIZING), "num_prompts": [num_prompts]})
    (level,) = build_levels(tokenizer, [16], args, random.Random(args.seed))
    render = hf_render(tokenizer)
    out = {}
    for phase, trace in level.traces.items():
        out[phase] = []
        for req in trace:
            placed = place_documents(render, document_messages(req.sys, req.question), [level.docs[d] for d in req.doc_ids],
                                     tokenizer, max_chunks=len(req.doc_ids), max_chunk_len=1 << 20)
            out[phase].append((placed.token_ids, placed.boundaries))
    return out


def laid_out(token_ids: list[int], boundaries: list[int], pad: bool, filler: int,
             block: int = BLOCK) -> tuple[list[int], list[Doc]]:
    """The prompt as it would run and its documents; ``pad``: the system prompt and each document
    padded to whole blocks with ``filler`` (in place), else as placed. Entries are keyed by the
    system prompt and the document's tokens (isolated mode's key)."""
    padded = (lambda ids: ids + [filler] * (-len(ids) % block)) if pad else (lambda ids: ids)
    sys_ids = tuple(token_ids[:boundaries[0]])
    tokens, docs = list(padded(list(sys_ids))), []
    for lo, hi in zip(boundaries, boundaries[1:]):
        chunk = token_ids[lo:hi]
        start = len(tokens)
        tokens += padded(chunk)  # an entry is its document and its filler: computed once, whole blocks
        docs.append(Doc((sys_ids, tuple(chunk)), start, len(tokens)))
    return tokens + token_ids[boundaries[-1]:], docs


def make_scheduler(model_path, num_blocks: int, block: int = BLOCK, batched: int = 2048, seqs: int = 128):
    """vLLM's synchronous ``Scheduler`` over ``num_blocks`` blocks of ``block`` tokens with
    ``SimConnector`` (``batched``: max_num_batched_tokens, ``seqs``: max_num_seqs), and its hasher."""
    from vllm.config import KVTransferConfig

    scheduler, _, hasher = vllm_scheduler(
        model_path, num_blocks=num_blocks, block_size=block, max_num_batched_tokens=batched, max_num_seqs=seqs,
        max_model_len=2048, kv_transfer_config=KVTransferConfig(
            kv_connector="SimConnector", kv_connector_module_path="perf.host.in_place", kv_role="kv_both"))
    return scheduler, hasher


def step(scheduler) -> tuple[object, set[str]]:
    """One step: schedule, a token for each request whose prompt is done, the output taken back;
    the ids of the requests that left."""
    from vllm.v1.outputs import ModelRunnerOutput

    from graphchunk.engine.context_scheduler import computed_before

    before = set(scheduler.requests)
    so = scheduler.schedule()
    ids, computed = list(so.num_scheduled_tokens), computed_before(so)
    done = [computed[r] + so.num_scheduled_tokens[r] >= scheduler.requests[r].num_prompt_tokens for r in ids]
    scheduler.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                       sampled_token_ids=[[7] if d else [] for d in done]))
    return so, before - set(scheduler.requests)


def pool_blocks_named(scheduler, first_pool_id: int) -> int:
    manager = scheduler.kv_cache_manager
    return len({b for r in scheduler.running for b in manager.get_block_ids(r.request_id)[0] if b >= first_pool_id})


def run_pass(scheduler, hasher, requests, concurrency: int, output_len: int) -> dict:
    """``requests`` ((tokens, docs) each) through ``scheduler``, ``concurrency`` outstanding."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    connector, own = scheduler.connector, scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    queue, live, samples = list(enumerate(requests)), set(), []
    hits, misses, evictions = connector.hits, connector.misses, connector.owner.evictions
    preempted, scheduled_prompt = 0, 0
    while queue or live:
        while queue and len(live) < concurrency:
            i, (tokens, docs) = queue.pop(0)
            req_id = f"{id(requests)}-{i}"
            connector.docs[req_id] = docs
            scheduler.add_request(Request(req_id, tokens, SamplingParams(max_tokens=output_len, ignore_eos=True),
                                          None, block_hasher=hasher))
            live.add(req_id)
        so, left = step(scheduler)
        preempted += len(so.preempted_req_ids or ())
        scheduled_prompt += sum(n for r, n in so.num_scheduled_tokens.items() if n > 1)
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        samples.append((len(scheduler.running), own - 1 - free, pool_blocks_named(scheduler, own)))
        live -= left
    block_pool = scheduler.kv_cache_manager.block_pool
    assert block_pool.get_num_free_blocks() == own - 1, "vLLM's blocks were not all given back"
    assert not +connector.owner.refs, f"pool blocks still held: {+connector.owner.refs}"
    running, held, named = zip(*samples)
    spread = lambda xs: {"median": statistics.median(xs), "max": max(xs)}  # noqa: E731
    return {"requests": len(requests), "steps": len(samples), "running_at_once": spread(running),
            "vllm_blocks_held": spread(held), "pool_blocks_named": spread(named), "preemptions": preempted,
            "prompt_tokens_scheduled": scheduled_prompt, "pool_hits": connector.hits - hits,
            "pool_misses": connector.misses - misses, "pool_evictions": connector.owner.evictions - evictions}


def run_kind(kind: str, concurrency: int, args, model_path, passes, filler: int) -> dict:
    mode, _, share = kind.partition("/pool=")
    pool = int(args.blocks * float(share)) if share else 0
    scheduler, hasher = make_scheduler(model_path, args.blocks - pool)
    scheduler.connector.kind, scheduler.connector.owner = mode, Owner(args.blocks - pool, pool)
    row = {"kind": kind, "concurrency": concurrency, "vllm_blocks": args.blocks - pool, "pool_blocks": pool}
    for phase, reqs in passes.items():
        laid = [laid_out(ids, bounds, mode == "in_place", filler) for ids, bounds in reqs]
        row[phase] = run_pass(scheduler, hasher, laid, concurrency, args.output_len)
        row[phase]["prompt_tokens_mean"] = statistics.mean(len(t) for t, _ in laid)
    return row


def checks(rows: list[dict]) -> dict:
    """Every pass gave vLLM back all its blocks and the pool every hold (``run_pass`` asserts it, so a
    written result has held it); per concurrency and share, in place ran at least as many requests
    at once (median, warm) as copying."""
    def at(kind, c):
        return next((r["warm"]["running_at_once"]["median"] for r in rows
                     if r["kind"] == kind and r["concurrency"] == c), None)

    pairs = [(at(r["kind"], r["concurrency"]), at(r["kind"].replace("in_place", "copy"), r["concurrency"]))
             for r in rows if r["kind"].startswith("in_place")]
    return {"accounting_held": True,
            "in_place_at_least_as_many_at_once_as_copy": all(c is None or p >= c for p, c in pairs) if pairs else None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS))
    p.add_argument("--blocks", type=int, default=192, help="the KV-cache budget in blocks of 128 tokens (sizing: 192)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 48],
                   help="requests outstanding; each level's passes have max(64, 4 x concurrency) requests "
                        "(16: the sizing run's)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--out", default="perf/results/in_place.json")
    return H.parse_with_quick(p, argv, {"out": None, "concurrency": [16]})


def table(rows: list[dict]) -> str:
    lines = ["| concurrency | kind | vLLM's blocks | running at once (median / max) | vLLM's blocks held | pool blocks named "
             f"| steps (x {BASE}) | preemptions | pool misses |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b["warm"]["steps"] for b in rows if b["kind"] == BASE and b["concurrency"] == r["concurrency"]),
                    None)
        w = r["warm"]
        ratio = f" ({base / w['steps']:.2f}x)" if base else ""
        lines.append(f"| {r['concurrency']} | {r['kind']} | {r['vllm_blocks']} | {w['running_at_once']['median']:g} / "
                     f"{w['running_at_once']['max']} | {w['vllm_blocks_held']['median']:g} / {w['vllm_blocks_held']['max']} | "
                     f"{w['pool_blocks_named']['median']:g} / {w['pool_blocks_named']['max']} | {w['steps']}{ratio} | "
                     f"{w['preemptions']} | {w['pool_misses']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    H.script_env()
    args = parse_args(argv)
    clock = H.RunClock()
    model_path = H.resolve_model("smollm2")
    tokenizer = H.load_tokenizer(model_path)
    filler = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with in_place_patch():
        rows = []
        for c in args.concurrency:
            passes = prompts(tokenizer, 12 if args.quick else max(64, 4 * c))
            rows += [run_kind(kind, c, args, model_path, passes, filler) for kind in args.kinds]
    print(table(rows))
    result = {"benchmark": "in_place: documents shared in place through vLLM's scheduler with a test-only patch",
              "command": H.command_line(__file__, argv), "config": H.config_dict(args),
              "model": str(model_path), "device": "scheduler only (no model runs)", "environment": clock.environment(),
              "filler_token": filler, "rows": rows, "table": table(rows), "checks": checks(rows)}
    if args.out:
        H.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
