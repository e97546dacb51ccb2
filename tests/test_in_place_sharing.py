"""Documents shared in place (issue 71, deliverable 3) through vLLM's own scheduler with the change
docs/architecture.md names applied as a test-only patch (``perf/host/in_place.py``): vLLM's
accounting holds through admissions, preemptions, aborts in every state and pool evictions
(randomized), and the measurement of what the change would buy (``perf/host/bench_in_place.py``)
shows what it ran.

After every step: vLLM's forward wrote only its own blocks; each of vLLM's own blocks is counted by exactly the requests vLLM holds that hold
it, and its free queue holds exactly the others (never a pool block); the pool's owner holds each of
its blocks exactly as often as those requests name it; no pool block is in vLLM's prefix cache;
and a request naming a pool block at a document's place names that document's entry, whole, still
in the pool (an entry named by a request is never evicted or reused under it).
"""
from __future__ import annotations

import collections
import random

from perf.host import bench_in_place as B
from perf.host.in_place import Owner, in_place_patch
from schedule_harness import check_blocks

BLOCK = 16
OWN = 24
"""vLLM's blocks: few enough that requests with long outputs are preempted."""
POOL = 20
"""The pool's: fewer than the documents' entries take, so entries are evicted."""
STEPS = 220


def check(scheduler, owner: Owner, docs: dict) -> None:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    check_blocks(scheduler, OWN)
    tables = {r: manager.get_block_ids(r)[0] for r in scheduler.requests}
    holders = collections.Counter(b for ids in tables.values() for b in ids)
    assert +owner.refs == collections.Counter({b: n for b, n in holders.items() if b >= OWN}), \
        "the pool's holds are not the requests naming its blocks"
    cached = [b for blocks in pool.cached_block_hash_to_block._cache.values()
              for b in (blocks.values() if isinstance(blocks, dict) else [blocks])]
    assert all(b.block_id < OWN for b in cached), "a pool block is in vLLM's prefix cache"
    assert all(b.block_hash is None for e in owner.entries.values() for b in e.blocks)
    for req_id, ids in tables.items():
        for doc in docs[req_id]:
            lo, hi = doc.start // BLOCK, -(-doc.end // BLOCK)
            if len(ids) >= hi and any(b >= OWN for b in ids[lo:hi]):
                entry = owner.entries.get(doc.key)
                assert entry is not None and ids[lo:hi] == [b.block_id for b in entry.blocks], \
                    f"request {req_id} names pool blocks {ids[lo:hi]} that are not its document's entry"


def check_writes(scheduler, so) -> None:
    """vLLM's forward writes no pool block: every token it scheduled lands in a block of its own."""
    from graphchunk.engine.context_scheduler import computed_before

    computed = computed_before(so)
    for req_id, n in so.num_scheduled_tokens.items():
        if req_id in scheduler.requests:
            ids = scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            written = ids[computed[req_id] // BLOCK:(computed[req_id] + n - 1) // BLOCK + 1]
            assert all(b < OWN for b in written), f"request {req_id}'s forward writes pool blocks {written}"


class Traffic:
    """Requests of a system prompt, 0-3 documents (drawn from a few shared ones) and a question,
    laid out padded as in place; some outputs long enough to be preempted."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.systems = [[1000 * (k + 1) + i for i in range(rng.randint(3, 24))] for k in range(2)]
        self.docs = [[20000 + 500 * k + i for i in range(rng.randint(5, 44))] for k in range(7)]
        self.count = 0

    def request(self, scheduler, hasher, docs: dict):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        rng = self.rng
        tokens, boundaries = list(rng.choice(self.systems)), []
        for doc in rng.sample(self.docs, rng.choice([0, 1, 2, 3, 3])):
            boundaries.append(len(tokens))
            tokens += doc
        boundaries.append(len(tokens))
        tokens += [40000 + rng.randrange(50) for _ in range(rng.randint(1, 20))]
        laid, found = B.laid_out(tokens, boundaries, True, 0, BLOCK) if len(boundaries) > 1 else (tokens, [])
        self.count += 1
        req_id = f"r{self.count}"
        docs[req_id] = found
        scheduler.connector.docs[req_id] = found
        params = SamplingParams(max_tokens=rng.choice([1, 4, 16, 60, 150]), ignore_eos=True)
        scheduler.add_request(Request(req_id, laid, params, None, block_hasher=hasher))


def run(seed: int, smollm2_path) -> collections.Counter:
    from vllm.v1.request import RequestStatus

    rng, seen = random.Random(seed), collections.Counter()
    scheduler, hasher = B.make_scheduler(smollm2_path, OWN, block=BLOCK, batched=64, seqs=6)
    owner = Owner(OWN, POOL)
    scheduler.connector.kind, scheduler.connector.owner = "in_place", owner
    traffic, docs = Traffic(rng), {}
    for _ in range(STEPS):
        while len(scheduler.requests) < 9 and rng.random() < 0.6:
            traffic.request(scheduler, hasher, docs)
        if scheduler.requests and rng.random() < 0.12:
            req_id = rng.choice(sorted(scheduler.requests))
            seen[f"abort {scheduler.requests[req_id].status.name}"] += 1
            scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            check(scheduler, owner, docs)
        so, _ = B.step(scheduler)
        check_writes(scheduler, so)
        seen["preemptions"] += len(so.preempted_req_ids or ())
        seen["pool blocks named"] += B.pool_blocks_named(scheduler, OWN)
        check(scheduler, owner, docs)
    seen["evictions"] = owner.evictions
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    check(scheduler, owner, docs)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == OWN - 1 and not +owner.refs
    return seen


def test_vllm_accounting_holds_with_documents_shared_in_place(smollm2_path):
    seen = collections.Counter()
    with in_place_patch():
        for seed in range(6):
            seen.update(run(seed, smollm2_path))
    # The traffic reached every case the checks are about.
    for case in ("abort WAITING", "abort RUNNING", "abort PREEMPTED", "preemptions", "evictions", "pool blocks named"):
        assert seen[case] > 0, (case, seen)


def test_without_the_patch_documents_take_vllms_blocks(smollm2_path):
    """The connector's supply is what the patch reads: unpatched, vLLM allocates every block itself."""
    scheduler, hasher = B.make_scheduler(smollm2_path, OWN, block=BLOCK, batched=64, seqs=6)
    scheduler.connector.kind, scheduler.connector.owner = "in_place", Owner(OWN, POOL)
    traffic, docs = Traffic(random.Random(0)), {}
    for _ in range(3):
        traffic.request(scheduler, hasher, docs)
    for _ in range(30):
        B.step(scheduler)
        assert B.pool_blocks_named(scheduler, OWN) == 0
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)


def test_the_measurement_reports_what_it_ran(tmp_path):
    out = tmp_path / "in_place.json"
    assert B.main(["--quick", "--out", str(out), "--kinds", "vanilla,copy/pool=0.5,in_place/pool=0.5"]) == 0
    import json

    result = json.loads(out.read_text())
    rows = {r["kind"]: r["warm"] for r in result["rows"]}
    assert set(rows) == {"vanilla", "copy/pool=0.5", "in_place/pool=0.5"}
    assert rows["vanilla"]["pool_blocks_named"]["max"] == rows["copy/pool=0.5"]["pool_blocks_named"]["max"] == 0
    assert rows["in_place/pool=0.5"]["pool_blocks_named"]["max"] > 0
    # The copy's documents take vLLM's blocks, in place they do not: fewer held for the same requests.
    assert rows["in_place/pool=0.5"]["vllm_blocks_held"]["max"] < rows["copy/pool=0.5"]["vllm_blocks_held"]["max"]
    assert result["checks"]["accounting_held"] is True
