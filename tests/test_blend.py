"""Blend mode's host side: recompute policies, the tokens each picks, and the plan over a fake device.

The fake device's "KV" of a token is (the tokens it attended to, its position), so a chunk computed
alone and moved shows (its own prefix, the position where it landed), and a recomputed token shows
the request's whole prefix.
"""
import math

import numpy as np
import pytest
import torch

from graphchunk.blend.recompute import RecomputePolicy, cacheblend_tokens, legolink_tokens, recompute, select_tokens
from graphchunk.cache.chunk_cache import ChunkCache, ScheduledPrompt
from graphchunk.cache.keys import KeySpace
from graphchunk.cache.pool import ChunkPool
from graphchunk.device import consecutive_runs
from graphchunk.metrics import CacheMetrics
from graphchunk.segments import split_at
from test_chunk_cache import BS, FakeDevice, make_prompt, request_blocks


class BlendDevice(FakeDevice):
    """FakeDevice whose forwards do not insist on exact causal prefixes (blend reuses approximate
    KV), record their calls, and whose check forwards (``num_layers``) write the given K."""

    def __init__(self, check_keys=None, attention=None):
        super().__init__()
        self.keys, self.calls = {}, []
        self.check_keys = check_keys or {}  # logical token -> K a check forward writes there
        self.attention = attention or {}  # logical token -> the question's attention to it

    def prefill(self, seqs, num_layers=None):
        self.calls.append((num_layers, [(s.num_cached, len(s.token_ids)) for s in seqs]))
        for seq in seqs:
            for i in range(seq.num_cached, len(seq.token_ids)):
                slot = self.slot(seq.block_ids, i)
                if num_layers is None:
                    self.kv[slot] = (tuple(seq.token_ids[: i + 1]), int(seq.positions[i]))
                else:
                    self.keys[slot] = self.check_keys.get(i, 0.0)

    def copy_slots_rotated(self, src, dst, deltas):
        for s, d, delta in zip(src.tolist(), dst.tolist(), deltas.tolist()):
            tokens, position = self.kv[s]
            self.kv[d] = (tokens, position + delta)
            self.keys[d] = 0.0

    def read_keys(self, layer, slots):
        return torch.tensor([self.keys.get(s, 0.0) for s in slots.tolist()]).view(-1, 1, 1)

    def sum_over_ranks(self, values):
        return values

    def context_attention(self, seqs, num_layers=None):
        self.prefill(seqs)
        self.calls[-1] = ("scored" if num_layers is None else f"scored@{num_layers}", self.calls[-1][1])
        return [torch.tensor([self.attention.get(t, 0.0) for t in range(s.num_cached)]) for s in seqs]


def blend_cache(check_layer=1, budget=1000):
    return ChunkCache(ChunkPool(64, BS, first_block_id=1000), KeySpace("m", "f32"), budget, check_layer)


def naive_kv(seg, t):
    """Blend without recomputation: sys causal; a chunk token attended to its own chunk only, at
    the position where the chunk landed."""
    if t < seg.layout.sys_len:
        return seg.sys_tokens[: t + 1], t
    for i, (begin, end) in enumerate(seg.bounds[1:-1]):
        if begin <= t < end:
            return seg.chunk_tokens(i)[: t - begin + 1], t


def fresh_kv(seg, t):
    return seg.token_ids[: t + 1], t


def scheduled(seg, policy, start=0, end=None, first_block=0):
    end = seg.layout.num_tokens if end is None else end
    return ScheduledPrompt(seg, None, start, end, request_blocks(first_block, seg), policy)


# --- policies ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(name="bogus"), "policy must be one of"), (dict(ratio=1.5), "ratio"), (dict(ratio=True), "ratio"),
    (dict(ratio="0.1"), "ratio"), (dict(tokens=-1), "tokens"), (dict(tokens=2.0), "tokens"),
    (dict(sinks=-1), "sinks"), (dict(sinks=True), "sinks"), (dict(spread="doc"), "spread must be one of"),
    (dict(layers=-1), "layers must be an integer >= 0"), (dict(layers=True), "layers"), (dict(layers=1.0), "layers"),
])
def test_bad_policies_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecomputePolicy(**kwargs)


def test_cacheblend_picks_the_largest_deviations_in_order():
    candidates = np.arange(10, 20)
    deviation = np.array([0.1, 5, 0.2, 5, 9, 0, 0, 3, 0, 0])
    assert cacheblend_tokens(candidates, deviation, 0.3).tolist() == [11, 13, 14]  # ties: the earlier token
    assert cacheblend_tokens(candidates, deviation, 0.05).tolist() == [14]  # ceil(0.5) = 1
    assert cacheblend_tokens(candidates, deviation, 0.0).tolist() == []
    assert cacheblend_tokens(candidates, deviation, 1.0).tolist() == list(range(10, 20))


def test_sinks_and_spread_refine_the_ranking():
    """Sinks are the first tokens of every chunk, taken first within ceil(ratio * n); spread 'chunk'
    takes ceil(ratio * n) of every chunk's own candidates; with neither, CacheBlend's pick."""
    spans = [(10, 14), (14, 20)]
    candidates = np.arange(10, 20)
    scores = np.array([0, 0, 5, 6, 0, 0, 9, 8, 7, 1.0])
    policy = RecomputePolicy("question", 0.3)
    assert select_tokens(candidates, scores, policy, spans).tolist() == cacheblend_tokens(candidates, scores, 0.3).tolist() \
        == [16, 17, 18]
    assert select_tokens(candidates, scores, RecomputePolicy("question", 0.3, sinks=1), spans).tolist() == [10, 14, 16]
    assert select_tokens(candidates, scores, RecomputePolicy("question", 0.3, spread="chunk"), spans).tolist() \
        == [12, 13, 16, 17]  # ceil(1.2) of the first chunk, ceil(1.8) of the second
    assert select_tokens(candidates, scores, RecomputePolicy("question", 0.3, sinks=1, spread="chunk"),
                         spans).tolist() == [10, 13, 14, 16]
    # More sinks than the ratio's count: all of them. A step's candidates start mid-chunk: only its own.
    assert select_tokens(candidates, scores, RecomputePolicy("cacheblend", 0.1, sinks=2), spans).tolist() \
        == [10, 11, 14, 15]
    assert select_tokens(np.arange(12, 20), scores[2:], RecomputePolicy("question", 0.25, sinks=1), spans).tolist() \
        == [14, 16]
    assert RecomputePolicy("question", 0.3, sinks=4, spread="chunk").describe() == "question:0.3+sinks:4/chunk"
    assert RecomputePolicy("question", 0.3).describe() == "question:0.3"
    assert RecomputePolicy("question", 0.15, sinks=2, layers=2).describe() == "question:0.15+sinks:2@2"
    assert RecomputePolicy("cacheblend", 0.15, layers=2).describe() == "cacheblend:0.15"  # question's alone
    assert RecomputePolicy("question", 0.3, sinks=2, block=16, spread="chunk").describe() == \
        "question:0.3+sinks:2x16/chunk"


def test_blocks_pick_whole_runs_by_their_summed_scores():
    """block B: each chunk span cut into blocks of B from its first token; the blocks with the
    largest summed scores whole, the last one taken cut to its first tokens; sinks first."""
    spans = [(10, 15), (15, 20)]  # blocks of 2: [10,12) [12,14) [14] [15,17) [17,19) [19]
    candidates = np.arange(10, 20)
    scores = np.array([0, 0, 5, 0, 9, 1, 1, 3, 3, 0.0])  # sums 0, 5, 9, 2, 6, 0
    pick = lambda ratio, **kw: select_tokens(candidates, scores, RecomputePolicy("question", ratio, block=2, **kw),
                                             spans).tolist()
    assert pick(0.3) == [14, 17, 18]  # [14] (9), then [17,19) (6)
    assert pick(0.4) == [12, 14, 17, 18]  # then the first token of [12,14) (5)
    assert pick(0.3, sinks=1) == [10, 14, 15]  # sinks 10 and 15, then [14]
    assert pick(0.2, spread="chunk") == [14, 17]  # one token of each chunk: [14]; [17,19)'s first
    # A step's candidates start mid-block: 13 is the block [12,14) cut to its candidates.
    assert select_tokens(np.arange(13, 20), scores[3:] + [9, 0, 0, 0, 0, 0, 0], RecomputePolicy("question", 0.3, block=2),
                         spans).tolist() == [13, 14, 17]
    assert pick(1.0) == list(range(10, 20)) and pick(0.0) == []


@pytest.mark.parametrize("seed", range(20))
def test_blocks_match_the_oracle_benchmarks_own_rule(seed):
    """The served pick (``select_tokens``) equals the HF oracle benchmark's independent
    ``block_tokens`` (``perf/answers/bench_oracle_quality.py``, which measured blocks against
    scattered picks) at the same count; with B = 1 it is the scattered pick itself."""
    from graphchunk.layout import Layout
    from perf.answers.bench_oracle_quality import block_tokens

    rng = np.random.default_rng(seed)
    lay = Layout(int(rng.integers(0, 20)), tuple(int(n) for n in rng.integers(1, 90, rng.integers(1, 7))), 5)
    candidates = np.arange(lay.sys_len, lay.context_len)
    scores = rng.integers(0, 30, len(candidates)).astype(float)  # ties too, and sums exact in any order
    spans = [(a, a + n) for a, n in zip(lay.chunk_starts(), lay.chunk_lens)]
    for ratio in (0.1, 0.3, 0.55):
        count = math.ceil(ratio * len(candidates) - 1e-9)
        for block in (1, 4, 16):
            picked = select_tokens(candidates, scores, RecomputePolicy("question", ratio, block=block), spans)
            assert picked.tolist() == block_tokens(lay, scores, count, block), (ratio, block)
        assert select_tokens(candidates, scores, RecomputePolicy("question", ratio, block=1), spans).tolist() == \
            cacheblend_tokens(candidates, scores, ratio).tolist()


def test_legolink_and_runs():
    assert legolink_tokens([(3, 8), (8, 10), (10, 20)], 3).tolist() == [3, 4, 5, 8, 9, 10, 11, 12]
    assert consecutive_runs(np.array([3, 4, 5, 8, 9, 10, 11, 12, 15])) == [(3, 3), (8, 5), (15, 1)]
    assert consecutive_runs(np.array([], np.int64)) == []


# --- the plan over a device -----------------------------------------------------------------------

def test_naive_reuse_moves_chunks_computed_alone_behind_any_sys():
    a = make_prompt(3, [5, 6])
    device, cc = BlendDevice(), blend_cache()
    first = scheduled(a, RecomputePolicy("none"))
    cc.materialize([first], device)
    for t in range(a.layout.context_len):
        assert device.kv[device.slot(first.block_ids, t)] == naive_kv(a, t), t
    computed = cc.metrics.tokens_computed
    # Other sys, chunks swapped: both chunks hit (their keys have no sys) and land at new positions.
    ids = [7, 7, 7, 7] + list(a.chunk_tokens(1)) + list(a.chunk_tokens(0)) + [9, 9]
    b = split_at(ids, [4, 10, 15], max_chunks=4, max_chunk_len=64)
    second = scheduled(b, RecomputePolicy("none"), first_block=20)
    cc.materialize([second], device)
    assert cc.metrics.tokens_computed - computed == 4, "only the new sys prompt is computed"
    assert (cc.metrics.blend_hits, cc.metrics.blend_misses) == (2, 2)
    for t in range(b.layout.context_len):
        assert device.kv[device.slot(second.block_ids, t)] == naive_kv(b, t), t
    cc.pool.check_invariants()


def test_isolated_and_blend_entries_never_satisfy_each_other():
    a = make_prompt(0, [5, 6])  # empty sys: an isolated chunk is computed alone too, and still not shared
    device, cc = BlendDevice(), blend_cache()
    cc.materialize([scheduled(a, None)], device)
    cc.materialize([scheduled(a, RecomputePolicy("none"), first_block=20)], device)
    cc.materialize([scheduled(a, None, first_block=40)], device)
    m = cc.metrics
    assert (m.misses, m.hits, m.blend_misses, m.blend_hits) == (4, 2, 2, 0)


def test_full_recompute_gives_every_chunk_token_fresh_kv_in_one_run():
    a = make_prompt(3, [5, 6])
    device, cc = BlendDevice(), blend_cache()
    prompt = scheduled(a, RecomputePolicy("cacheblend", 1.0))
    cc.materialize([prompt], device)
    assert device.calls[-1] == (None, [(3, 14)])
    for t in range(a.layout.context_len):
        assert device.kv[device.slot(prompt.block_ids, t)] == fresh_kv(a, t)
    assert cc.metrics.blend_tokens_recomputed == 11


def test_cacheblend_checks_every_chunk_token_then_recomputes_the_top_deviations():
    a = make_prompt(3, [5, 6])  # chunk tokens 3..13
    deviations = {4: 2.0, 5: 7.0, 9: 3.0, 12: 5.0}
    device, cc = BlendDevice(check_keys=deviations), blend_cache(check_layer=2)
    prompt = scheduled(a, RecomputePolicy("cacheblend", 0.3))
    cc.materialize([prompt], device)
    assert math.ceil(0.3 * 11) == 4
    picked = [4, 5, 9, 12]  # the four largest deviations
    assert (3, [(3, 14)]) in device.calls, "the check runs layers [0, check_layer] over every chunk token"
    assert device.calls[-1] == (None, [(4, 6), (9, 10), (12, 13)])
    for t in range(a.layout.context_len):
        expected = fresh_kv(a, t) if t in picked else naive_kv(a, t)
        assert device.kv[device.slot(prompt.block_ids, t)] == expected, t
    assert (cc.metrics.blend_tokens_checked, cc.metrics.blend_tokens_recomputed) == (11, 4)


def test_question_policy_recomputes_what_the_question_attends_to():
    """The question runs once over the reused context (its attention ranks the chunk tokens, sys
    tokens never count), then the top share is recomputed as CacheBlend's would be."""
    a = make_prompt(3, [5, 6])  # sys 0..2, chunk tokens 3..13, question 14..15
    attention = {0: 99.0, 4: 2.0, 6: 7.0, 10: 3.0, 13: 5.0}
    device, cc = BlendDevice(attention=attention), blend_cache()
    prompt = scheduled(a, RecomputePolicy("question", 0.3))
    cc.materialize([prompt], device)
    assert ("scored", [(14, 16)]) in device.calls and not any(c[0] == 2 for c in device.calls), "no check pass"
    assert device.calls[-1] == (None, [(4, 5), (6, 7), (10, 11), (13, 14)])
    for t in range(a.layout.context_len):
        expected = fresh_kv(a, t) if t in (4, 6, 10, 13) else naive_kv(a, t)
        assert device.kv[device.slot(prompt.block_ids, t)] == expected, t
    m = cc.metrics
    assert (m.blend_tokens_scored, m.blend_tokens_recomputed, m.blend_tokens_checked, m.blend_question_fallbacks) == \
        (2, 4, 0, 0)


def test_shallow_question_policy_scores_through_its_own_layers():
    """A step's questions are scored once per depth: a request with ``layers`` k through the first
    k layers, one with 0 through every layer; each picks by its own pass's attention."""
    a, b = make_prompt(3, [5, 6]), make_prompt(2, [4, 4], q_len=3)  # b's questions: 10..12
    device, cc = BlendDevice(attention={4: 2.0, 6: 7.0, 10: 3.0, 13: 5.0, 3: 1.0, 8: 4.0}), blend_cache()
    shallow = scheduled(a, RecomputePolicy("question", 0.3, layers=2))
    deep = scheduled(b, RecomputePolicy("question", 0.25), first_block=40)
    cc.materialize([shallow, deep], device)
    scored = [call for call in device.calls if str(call[0]).startswith("scored")]
    assert scored == [("scored", [(10, 13)]), ("scored@2", [(14, 16)])]
    assert device.calls[-1] == (None, [(6, 7), (8, 9), (10, 11), (13, 14), (6, 7), (8, 9)])  # a: 4 of 11; b: 2 of 8
    assert cc.metrics.blend_tokens_scored == 5


def test_question_policy_without_its_question_in_the_step_ranks_by_deviation():
    """Chunked prefill: a step that fills context but not the question cannot ask it; CacheBlend's
    deviation ranks that step's tokens, counted as a fallback. The question's step asks."""
    a = make_prompt(3, [5, 6])
    device, cc = BlendDevice(check_keys={5: 4.0, 7: 1.0}, attention={8: 0.5, 9: 1.0, 12: 2.0}), blend_cache()
    policy = RecomputePolicy("question", 0.4)
    first = scheduled(a, policy, 0, 8)  # chunk tokens 3..7
    cc.materialize([first], device)
    assert (2, [(3, 8)]) in device.calls and device.calls[-1] == (None, [(5, 6), (7, 8)])
    second = ScheduledPrompt(a, None, 8, a.layout.num_tokens, first.block_ids, policy)
    cc.materialize([second], device)
    assert ("scored", [(14, 16)]) in device.calls and device.calls[-1] == (None, [(8, 10), (12, 13)])
    assert (cc.metrics.blend_question_fallbacks, cc.metrics.blend_tokens_scored) == (1, 2)


def test_question_policy_whose_question_has_only_part_of_its_blocks_ranks_by_deviation():
    """vLLM allocates blocks for the tokens a step schedules: when the step's budget takes only part
    of the question, the request has no slots for the rest, where the scoring pass would write its
    KV. It ranks by deviation instead (a fallback), and never writes beyond the request's blocks."""
    a = make_prompt(3, [5, 6], q_len=9)  # context 14, question 14..22: 6 blocks of 4
    device, cc = BlendDevice(check_keys={5: 4.0, 7: 1.0}), blend_cache()
    blocks = request_blocks(0, a)[:4]  # context and two question tokens
    prompt = ScheduledPrompt(a, None, 0, a.layout.num_tokens, blocks, RecomputePolicy("question", 0.2))
    cc.materialize([prompt], device)
    assert not any(call[0] == "scored" for call in device.calls)
    assert (cc.metrics.blend_question_fallbacks, cc.metrics.blend_tokens_scored) == (1, 0)
    whole = ScheduledPrompt(a, None, 0, a.layout.num_tokens, request_blocks(100, a), RecomputePolicy("question", 0.2))
    cc.materialize([whole], device)
    assert cc.metrics.blend_tokens_scored == 9


def test_legolink_recomputes_chunk_starts_within_the_step_range():
    a = make_prompt(3, [5, 6, 4])  # chunks at 3, 8, 14
    device, cc = BlendDevice(), blend_cache()
    policy = RecomputePolicy("legolink", tokens=2)
    first = scheduled(a, policy, 0, 9)  # chunked prefill: this step fills tokens [0, 9)
    cc.materialize([first], device)
    assert device.calls[-1] == (None, [(3, 5), (8, 9)])
    second = ScheduledPrompt(a, None, 9, a.layout.num_tokens, first.block_ids, policy)
    cc.materialize([second], device)
    assert device.calls[-1] == (None, [(9, 10), (14, 16)])  # chunk 2's second token fell in this step
    for t in range(a.layout.context_len):
        expected = fresh_kv(a, t) if t in (3, 4, 8, 9, 14, 15) else naive_kv(a, t)
        assert device.kv[device.slot(first.block_ids, t)] == expected, t


def test_recompute_forwards_respect_the_token_budget():
    a = make_prompt(3, [5, 6])
    device = BlendDevice()
    prompt = scheduled(a, RecomputePolicy("cacheblend", 1.0))
    recompute([prompt], device, check_layer=1, budget=4, block_size=BS, metrics=CacheMetrics())
    assert [c[1] for c in device.calls] == [[(3, 7)], [(7, 11)], [(11, 14)]]


def test_blend_runs_as_full_prefill_where_the_model_cannot_blend():
    """A blend request for a model that cannot move keys (or cannot narrow its layers, for
    CacheBlend) gets no policy: the scheduler's connector, told what the model allows by the
    workers' handshake, reads it as an ordinary prompt (it loads nothing: vLLM computes the full
    prefill, blend's exact target), and the workers, which hold only the segmented requests the
    scheduler names (``StepWork.requests``), run it as one."""
    from types import SimpleNamespace

    from graphchunk.config import GraphChunkConfig
    from graphchunk.engine.blend_support import BlendSupport
    from graphchunk.engine.context_scheduler import ContextScheduler, PoolHandshake
    from graphchunk.engine.request_args import chunk_request

    args = {"graphchunk_boundaries": [2, 5, 8], "graphchunk_mode": "blend", "graphchunk_recompute": "cacheblend",
            "graphchunk_recompute_ratio": 0.3, "graphchunk_recompute_tokens": 4}

    def registered(blend: BlendSupport, extra_args: dict):
        handshake = PoolHandshake(0, 1, 4, None, blend.refusal, blend.check_refusal)  # the workers' to the scheduler
        scheduler = ContextScheduler(GraphChunkConfig(), handshake)
        scheduler.publisher = None
        scheduler._request("r", list(range(12)), extra_args)
        segmented = scheduler._segmented([SimpleNamespace(req_id="r")])
        assert handshake.runs(chunk_request(list(range(12)), extra_args, GraphChunkConfig())) == bool(segmented)
        return segmented[0][1].policy if segmented else None

    assert registered(BlendSupport(object()), args) == RecomputePolicy("cacheblend", 0.3, 4, block=GraphChunkConfig().recompute_block)
    no_check = BlendSupport(object(), check_refusal="no layer range")
    assert registered(no_check, args) is None
    assert registered(no_check, {**args, "graphchunk_recompute": "legolink"}) is not None
    no_rotation = BlendSupport(None, "no rotary embedding", "no layer range")
    assert registered(no_rotation, {**args, "graphchunk_recompute": "legolink"}) is None


def test_a_capture_fills_entries_from_a_prefilled_request_out_of_the_jobs_order():
    """``EntryCapture`` (blend_entries 'context'), after the forward of the step that prefilled the
    request: each segment's KV as that prefill computed it (the chunk attended to everything before
    it) lands in its entry with its keys moved back by where it sat (the fake's position). Captures
    run whole in their step, out of the jobs' order: ``done_before`` stays at a queued job that has
    not run yet, and passes every id once it has."""
    from graphchunk.cache.context_plan import EntryCapture, MissJob
    from graphchunk.cache.context_run import ContextRunner

    seg = make_prompt(3, [6, 5])  # sys [0, 3), chunks [3, 9) and [9, 14), question [14, 16)
    device, blocks = BlendDevice(), request_blocks(0, seg)
    for t in range(seg.layout.num_tokens):  # vLLM's full prefill of the request
        device.kv[device.slot(blocks, t)] = fresh_kv(seg, t)
    runner = ContextRunner(BS, 1000, CacheMetrics())
    job = MissJob(0, (7, 8), (900,), 0, (900,), b"k", (7, 8), 2, "blend")
    runner.add_jobs([job])
    runner.run_jobs(device, budget=0)
    entries = {1: (2000, 2001), 2: (2002, 2003)}
    runner.capture([EntryCapture(1, "r", 3, 9, entries[1], 5), EntryCapture(2, "r", 9, 14, entries[2], 6)], device,
                   {"r": blocks}.__getitem__)
    for (lo, hi), entry in zip([(3, 9), (9, 14)], entries.values()):
        assert [device.kv[device.slot(entry, j)] for j in range(hi - lo)] == \
            [(fresh_kv(seg, lo + j)[0], j) for j in range(hi - lo)]
    assert runner.metrics.blend_entries_captured == 2 and runner.epochs[2002] == 6
    assert runner.done_before == 0  # job 0 is queued, not run
    runner.run_jobs(device)
    assert runner.done_before == 3


def test_a_fixed_prefix_is_computed_before_every_chunk_and_its_tokens_are_never_copied():
    """``blend_prefix`` (``KeySpace.blend_prefix``): a blend miss job computes ``prefix ‖ chunk``
    from position 0; the request gets each chunk token's KV (which attended to the prefix and the
    chunk's earlier tokens) moved from m + j to where it lands, never the prefix's own; the key
    and the entry's tokens carry the prefix. A capture (blend_entries 'context') fills such an entry
    after where the prefix would be, at the same positions."""
    from graphchunk.cache.context_plan import EntryCapture
    from graphchunk.cache.context_run import ContextRunner

    prefix = (90, 91, 92)
    a = make_prompt(3, [5, 6])
    device = BlendDevice()
    cc = ChunkCache(ChunkPool(64, BS, first_block_id=1000), KeySpace("m", "f32", blend_prefix=prefix), 1000)
    first = scheduled(a, RecomputePolicy("none"))
    cc.materialize([first], device)
    for i, (begin, end) in enumerate(a.bounds[1:-1]):
        for t in range(begin, end):
            assert device.kv[device.slot(first.block_ids, t)] == (prefix + tuple(a.chunk_tokens(i)[: t - begin + 1]), t)
        entry = cc.pool.lookup(*cc.planner._identity(a, None, "blend", i))
        assert entry.tokens == prefix + tuple(a.chunk_tokens(i)) and entry.num_tokens == len(prefix) + end - begin
    plain = ChunkCache(ChunkPool(64, BS, first_block_id=1000), KeySpace("m", "f32"), 1000)
    assert plain.planner._identity(a, None, "blend", 0)[0] != cc.planner._identity(a, None, "blend", 0)[0]
    blocks = request_blocks(0, a)
    for t in range(a.layout.num_tokens):
        device.kv[device.slot(blocks, t)] = fresh_kv(a, t)
    runner = ContextRunner(BS, 1000, CacheMetrics())
    runner.capture([EntryCapture(0, "r", 3, 8, (2000, 2001), 1, offset=len(prefix))], device, {"r": blocks}.__getitem__)
    assert [device.kv[device.slot((2000, 2001), len(prefix) + j)] for j in range(5)] == \
        [(fresh_kv(a, 3 + j)[0], len(prefix) + j) for j in range(5)]
