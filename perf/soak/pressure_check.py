"""What the pressure soak (``pressure.py``) reads after its traffic: the server log's error lines
(those an injected fill failure causes counted apart), the injected fill failures the log shows
(and the copies that failed their check: each request is planned again),
and the HF references every completed prompt is compared with, token for token.

Contract: ``error_lines`` and ``fill_faults`` read a log and decide nothing; ``References.verdict``
says whether one completed prompt equals its reference (``equal``), differs only at a float near
tie (``tie``, with its logprob gap) or is ``wrong``; each reference is computed once.
"""
from __future__ import annotations

import collections
import json
import re
import time
from pathlib import Path

from graphchunk.cache.context_run import POISONED
from perf.common.trace import Encoder, Item
from perf.soak.check import _prompt
from perf.soak.fill_faults import INJECTED

ISOLATED_MODES = ("isolated", "isolated-host")
"""The soak's modes whose answers are isolated mode's (the masked oracle's); the others' are a causal
prefill's."""

ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL|Traceback|Exception|EngineDeadError|AssertionError)\b")
FILL_FAILED = re.compile(r"a context fill of request \S+ would copy pool blocks .*? \(epochs (\[[^\]]*\]), "
                         r"found (\[.*\])\); it is planned again")
"""graphchunk's warning for a copy that failed its check (``ContextRunner._check``)."""
FAULT_LINES = re.compile(r"reads pool blocks .* that no longer hold")
"""The error lines an injected fill failure causes: graphchunk's, for a job that read a poisoned entry."""


def error_lines(log_path: str, faults: bool, limit: int = 40) -> dict:
    """The server log's lines that look like errors, before its shutdown began (count and the first
    ``limit``) and after (vLLM's own SIGTERM teardown logs an EngineDeadError traceback: counted
    apart); with ``faults`` (fill failures injected) the lines they cause are counted apart too."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return {"count": None, "lines": [], "at_shutdown": None, "from_injected_faults": None}
    end = next((i for i, line in enumerate(lines) if "[shutdown]" in line), len(lines))
    found = [line for line in lines[:end] if ERROR_LINE.search(line)]
    expected = [line for line in found if faults and FAULT_LINES.search(line)]
    found = [line for line in found if line not in expected]
    return {"count": len(found), "lines": found[:limit], "from_injected_faults": len(expected),
            "at_shutdown": sum(bool(ERROR_LINE.search(line)) for line in lines[end:])}


def fill_faults(log_text: str) -> dict:
    """The injected fill failures the server log shows: entries poisoned (``perf.soak.fill_faults``),
    copies that failed their check and whether each found only poisoned blocks (an injection's,
    directly or through a job that read one: explained) or anything else (a real lifetime bug)."""
    injected = len(re.findall(re.escape(INJECTED), log_text))
    lines = FILL_FAILED.findall(log_text)
    failed = [json.loads(found) for _, found in lines]
    explained = sum(all(e == POISONED for unit in found for e in unit) for found in failed)
    per_epoch = collections.Counter(e for planned, _ in lines for e in json.loads(planned))
    return {"injected": injected, "copies_failed": len(failed), "copies_failed_unexplained": len(failed) - explained,
            "entries_read_poisoned": len(per_epoch), "most_copies_failed_per_entry": max(per_epoch.values(), default=0),
            "jobs_poisoned": len(re.findall(r"reads pool blocks .* that no longer hold", log_text))}


# --- references ---------------------------------------------------------------------------------

class References:
    """HF references in fp32, each computed once: isolated per (sys, chunks as a set, question),
    full prefill per token sequence."""

    def __init__(self, model_path, encoder: Encoder, max_tokens: int, tie_tol: float):
        import torch

        from graphchunk.reference.oracle import Oracle
        from graphchunk.segments import SeparatorSplitter

        self.oracle = Oracle(model_path, dtype=torch.float32)
        # generate() and causal_generate() read the last position's logits only: skip the
        # vocabulary projection of every prompt token (``Oracle._forward`` passes
        # logits_to_keep=0 for "all", which is raised to 1 here; a partial would be overridden).
        forward = self.oracle.model.forward
        self.oracle.model.forward = lambda *a, **k: forward(*a, **{**k, "logits_to_keep": k.get("logits_to_keep") or 1})
        self.encoder = encoder
        self.splitter = SeparatorSplitter(encoder.tokenizer, "##", max_chunks=64, max_chunk_len=1 << 20)
        self.max_tokens, self.tie_tol = max_tokens, tie_tol
        self.isolated_cache: dict = {}
        self.full_cache: dict = {}
        self.seconds = 0.0
        self.computed = {"isolated": 0, "full": 0, "own_order": 0, "tie": 0}
        """Reference generations run (isolated, full prefill; isolated again in a prompt's own
        order after a mismatch; the isolated logits at a first difference)."""

    def expected(self, item: Item):
        """(prompt ids, layout) as the server saw ``item``."""
        return _prompt(self.encoder, self.splitter, item)

    def verdict(self, mode: str, item: Item, prompt_ids, got: list[int] | None) -> dict:
        started = time.monotonic()
        try:
            ids, layout = self.expected(item)
            if prompt_ids is not None and list(prompt_ids) != list(ids):
                return {"verdict": "wrong", "why": "the server saw another prompt"}
            got = list(got or [])
            if mode in ISOLATED_MODES:
                return self._isolated(ids, layout, got)
            return self._full(ids, got)
        finally:
            self.seconds += time.monotonic() - started

    def _isolated(self, ids, layout, got) -> dict:
        starts = layout.chunk_starts()
        key = (tuple(ids[:layout.sys_len]), tuple(sorted(tuple(ids[s:s + n]) for s, n in zip(starts, layout.chunk_lens))),
               tuple(ids[layout.context_len:]))
        ref = self.isolated_cache.get(key)
        if ref is None:
            ref = self.isolated_cache[key] = self.oracle.generate(list(ids), layout, self.max_tokens,
                                                                  ignore_eos=True).tokens
            self.computed["isolated"] += 1
        if got == ref:
            return {"verdict": "equal"}
        # Cached from another document order: the oracle of this prompt's own order decides.
        own = self.oracle.generate(list(ids), layout, self.max_tokens, ignore_eos=True).tokens
        self.computed["own_order"] += 1
        if got == own:
            return {"verdict": "equal", "order_noise": True}
        if len(got) != len(own):
            return {"verdict": "wrong", "why": f"{len(got)} tokens, expected {len(own)}", "expected": own}
        from graphchunk.layout import Layout

        d = next(i for i, (x, y) in enumerate(zip(got, own)) if x != y)
        longer = Layout(layout.sys_len, layout.chunk_lens, layout.question_len + d)
        logp = self.oracle.generate(list(ids) + got[:d], longer, 1, ignore_eos=True).last_logits.log_softmax(-1)
        self.computed["tie"] += 1
        return self._gap(float(logp[own[d]] - logp[got[d]]), d, own)

    def _full(self, ids, got) -> dict:
        key = tuple(ids)
        if key not in self.full_cache:
            tokens, logprobs = self.oracle.causal_generate(list(ids), self.max_tokens)
            self.full_cache[key] = (tokens, logprobs)
            self.computed["full"] += 1
        ref, logprobs = self.full_cache[key]
        if got == ref:
            return {"verdict": "equal"}
        if len(got) != len(ref):
            return {"verdict": "wrong", "why": f"{len(got)} tokens, expected {len(ref)}", "expected": ref}
        d = next(i for i, (x, y) in enumerate(zip(got, ref)) if x != y)
        logp = logprobs[d]  # the same prefix up to d: the reference's distribution where they part
        return self._gap(float(logp[ref[d]] - logp[got[d]]), d, ref)

    def _gap(self, gap: float, d: int, ref: list[int]) -> dict:
        return {"verdict": "tie" if gap <= self.tie_tol else "wrong", "gap": gap, "first_difference": d,
                "expected": ref}
