"""The soak's correctness check: completed requests against ``graphchunk.reference.oracle``, token for token.

``check()`` takes a sample of the completed trace requests (``--check`` of them, seeded; the
first five after the restart always) plus every completed tagged request (canaries, final),
rebuilds each prompt and its layout as the server saw it (token ids with the client's boundaries,
or text split at the separators) and compares the server's tokens with the HF oracle's greedy
tokens (isolated mode). A verdict is ``equal``, ``tie`` (the tokens differ, but at the first
difference the oracle's own logprob gap between its token and the server's is at most
``--tie-tol``: a float near-tie) or ``wrong`` (also when the server echoed another prompt).
Returns the counts, the wrong and tied requests, the tagged verdicts and the tags that did not
complete.
"""
from __future__ import annotations

import functools
import random
import time

from perf.common.client import Outcome
from perf.common.trace import Encoder, Item


def check(outcomes: list[Outcome], extra_outcomes: list[Outcome], restart_at: int, encoder: Encoder,
          model_path, args) -> dict:
    """The oracle report of ``outcomes`` (the trace's) and ``extra_outcomes`` (the tagged ones)."""
    import torch

    from graphchunk.reference.oracle import Oracle
    from graphchunk.segments import SeparatorSplitter

    sample = _sample(outcomes, [o for o in extra_outcomes if o.status == "ok"], restart_at, args)
    oracle = Oracle(model_path, dtype=torch.float32)
    # generate() reads the last position's logits only: skip the vocabulary projection of
    # every prompt token (the same numbers, ~3x faster on the tiny model).
    oracle.model.forward = functools.partial(oracle.model.forward, logits_to_keep=1)
    splitter = SeparatorSplitter(encoder.tokenizer, "##", max_chunks=64, max_chunk_len=1 << 20)
    report = {"checked_outputs": 0, "wrong_outputs": 0, "near_ties": 0, "wrong": [], "ties": [],
              "tagged_checked": {}, "tagged_not_completed": [o.item.tag for o in extra_outcomes
                                                              if o.status != "ok"]}
    started = time.monotonic()
    for outcome in sample:
        item = outcome.item
        expected_ids, layout = _prompt(encoder, splitter, item)
        verdict = _compare(oracle, outcome, expected_ids, layout, args.max_tokens, args.tie_tol)
        report["checked_outputs"] += 1
        if item.tag:
            report["tagged_checked"][item.tag] = verdict
        if verdict == "wrong":
            report["wrong_outputs"] += 1
            report["wrong"].append({"index": item.index, "tag": item.tag, "docs": list(item.doc_ids),
                                    "got": outcome.token_ids, "incarnation": outcome.incarnation})
        elif verdict == "tie":
            report["near_ties"] += 1
            report["ties"].append(item.index)
    report["oracle_seconds"] = round(time.monotonic() - started, 1)
    return report


def _sample(outcomes: list[Outcome], tagged: list[Outcome], restart_at: int, args) -> list[Outcome]:
    """The tagged outcomes, the first five completed after the restart and ``--check`` others."""
    ok = [o for o in outcomes if o.status == "ok"]
    after_restart = [o for o in ok if o.item.index >= restart_at][:5] if restart_at >= 0 else []
    rest = [o for o in ok if o not in after_restart]
    rng = random.Random(args.seed + 1)
    count = len(rest) if args.check < 0 else min(len(rest), args.check)
    return tagged + after_restart + rng.sample(rest, count)


def _prompt(encoder: Encoder, splitter, item: Item):
    """(prompt token ids, layout) as the server saw ``item``."""
    from graphchunk.layout import Layout

    if item.as_ids:
        expected_ids, boundaries = encoder.ids(item)
        return expected_ids, _layout_from_boundaries(boundaries, len(expected_ids))
    expected_ids = encoder.tokenizer(encoder.text(item)).input_ids
    seg = splitter.split(expected_ids)
    return expected_ids, seg.layout if seg is not None else Layout(0, (), len(expected_ids))


def _layout_from_boundaries(boundaries: list[int], num_tokens: int):
    from graphchunk.layout import Layout

    chunks = tuple(b - a for a, b in zip(boundaries, boundaries[1:]) if b > a)
    return Layout(boundaries[0], chunks, num_tokens - boundaries[-1])


def _compare(oracle, outcome: Outcome, expected_ids: list[int], layout, max_tokens: int, tie_tol: float) -> str:
    from graphchunk.layout import Layout

    got = outcome.token_ids or []
    if outcome.prompt_ids is not None and list(outcome.prompt_ids) != list(expected_ids):
        return "wrong"  # the server did not see the prompt the client sent
    ref = oracle.generate(list(expected_ids), layout, max_tokens, ignore_eos=True).tokens
    if got == ref:
        return "equal"
    if len(got) != len(ref):
        return "wrong"
    d = next(i for i, (x, y) in enumerate(zip(got, ref)) if x != y)
    # The oracle's logits at the first difference (generated tokens so far as more question
    # tokens: same positions, same attention): a float near-tie if its own gap is tiny.
    longer = Layout(layout.sys_len, layout.chunk_lens, layout.question_len + d)
    logits = oracle.generate(list(expected_ids) + got[:d], longer, 1, ignore_eos=True).last_logits
    logp = logits.log_softmax(-1)
    gap = float(logp[ref[d]] - logp[got[d]])
    return "tie" if gap <= tie_tol else "wrong"
