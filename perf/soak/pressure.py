"""Soak under pool pressure: graphchunk's server with a chunk pool of about two requests' contexts,
every completed answer checked token for token.

    python -m perf.soak.pressure --mode isolated|blend-full|isolated-host|both|all [--model smollm2] [--requests 500] \
        [--concurrency 8] [--out perf/results/soak_pressure.json]

For each mode one graphchunk server (``vllm serve`` through the soak's ``perf.common.server.Servers``;
all started at once, the traffic one mode at a time):
``isolated`` runs ``"mode": "isolated"``, ``blend-full`` runs ``"mode": "blend"`` with
``"recompute_ratio": 1.0`` (every chunk token recomputed: full prefill), both without a tier, so
an evicted entry is computed again; ``isolated-host`` runs isolated with host memory below the pool
(``host_bytes`` of about ``--host-contexts`` (4) mean contexts, no directory: more than the pool,
less than the trace's entries), so an evicted entry comes back from host memory when it holds it
and host memory drops entries for room (its hits and drops must both happen). ``both`` is the
first two, ``all`` the three. The chunk pool holds about ``--pool-contexts`` (2) of the
trace's mean request contexts (sys + documents), or the start-up minimum the worker enforces
(``worker.min_pool_blocks``: max_model_len, one block, max_chunk_len) where that is larger;
``--max-model-len`` is derived from the longest prompt, so the minimum stays near two contexts.
vLLM's own KV cache (``--kv-cache-memory-bytes`` less the pool) holds ``--vllm-kv-seqs`` prompts
of max_model_len (default 1.5), so that vLLM preempts requests when the running ones grow (a
segmented request's context is allocated whole when it is admitted, so only the growth of
running requests can run vLLM out of blocks);
``--max-num-batched-tokens`` is small, so prompts prefill over several steps.

Trace (seeded, the same for both modes): ``--combos`` (sys prompt, document set) combinations
drawn from the soak's corpus (``perf.common.trace.build_corpus``: CPython help-topic text), each with
``--questions-per-combo`` questions; every request body picks a combination and question and
reorders the documents at random. Bodies are single prompts (token ids with explicit boundaries,
``vllm_xargs.graphchunk_boundaries``, or ``sys ## doc ## ... ## question`` text, whose
boundaries the server detects per prompt) or, at ``--batch-fraction``, a batch of 2-4 prompts in
one ``/v1/completions`` body (the completions API's list-of-prompts form): ``vllm_xargs`` is one
per body, so a batch of token ids shares one document order (same boundaries: the prompts differ
in their questions), a batch of text prompts mixes combinations and orders. ``--salt-fraction``
of the bodies carry a tenant ``cache_salt`` (it changes no answer, only which chunk entries a
request may use). Client disconnects at small rates (the soak's abort kinds: ``abort_stream``,
``abort_prefill``, ``abort_nostream``, ``perf.common.client.Client``), and at ``--abort-misses`` a body of
documents no other request carries (all misses), streamed and closed within
``--abort-misses-window`` seconds of the headers, while its misses are computed (a small
``--miss-budget`` spreads them over several steps); graphchunk counts the ones that left while
waiting for an asynchronous load (``loads_dropped``). Greedy, ``ignore_eos``, ``--max-tokens``.

Fill failures (``--fail-fill-every N``): the server runs ``perf.soak.fill_faults.FaultyRunner``, which
poisons one pool entry on every Nth step that copies from the pool (until the traffic ends): the
request copying it must be planned again and answered (``fills_retried``; never an HTTP error),
and the entry must leave the pool's index (``entries_failed``). The report attributes every failed
copy to an injection (``fill_faults``).

After the traffic: the engine drained (nothing running or waiting), graphchunk's pool gauges read
(``vllm:graphchunk_pool_refs_held`` and ``vllm:graphchunk_pool_blocks_leaked`` must be 0, and vLLM's
``vllm:kv_cache_usage_perc``: cancelled and failed requests gave their blocks back), a final
request checked (the server alive and correct; one that read an entry poisoned before the
injections stopped is planned again by the server), the counters read (evictions, hits, misses; ``vllm:num_preemptions_total``), the
server stopped and its log scanned for error lines. Then every completed prompt is compared with
its reference, token for token (HF transformers in fp32, ``graphchunk.reference.oracle``):

* isolated, isolated-host: the isolated oracle (explicit 4D mask and positions); its answer does not depend on
  the documents' order, so it is computed once per (sys, set of chunks, question) and cached; a
  mismatch is checked again against the oracle of the prompt's own order;
* blend-full: the plain causal forward of the same token ids (``Oracle.causal_generate``: what
  vanilla vLLM computes), cached per distinct token sequence.

A mismatch counts as wrong unless the reference's own logprob gap between its token and the
server's at the first difference is at most ``--tie-tol`` (a float near tie: counted apart as
``near_ties``, with its gap). Writes ``--out`` (JSON; a mode's ``passed``: 0 wrong, no failed
request (``requests_failed`` 0; failed copies retried), 0 references held, 0 blocks leaked and vLLM's KV cache unused
when idle, nothing left waiting, evictions > 0, the server alive and correct after the traffic,
no error line in its log before its shutdown but the injections') and exits 1 unless every mode
passed. vLLM's preemptions are counted, not required (a few per hundred bodies at the defaults).

This file runs the modes (``PressureSoak``) and holds the command line; beside it
``pressure_trace`` (the bodies, their encoder and client) and ``pressure_check`` (log scans, HF
references); from ``perf/common/`` ``trace`` (corpus, ``Item``, ``Encoder``), ``client``
(``Client`` and its abort kinds, ``Dispatcher``, ``client_threads``), ``server`` (``Servers``,
``server_flags``, /metrics) and ``harness``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from graphchunk.tools.serve_demo import VllmServer, free_port
from perf.common import harness as H
from perf.common.client import Dispatcher, Estimates, Outcome, client_threads, count_statuses
from perf.common.server import KV_USAGE, LEAK_GAUGES, Servers
from perf.common.trace import Item, build_corpus
from perf.soak.fill_faults import EVERY_ENV, OFF_ENV, SEED_ENV
from perf.soak.pressure_check import ISOLATED_MODES, References, error_lines, fill_faults
from perf.soak.pressure_trace import (PRESSURE_ACTIONS, Body, BodyClient, BodyEncoder, build_combos, build_trace,
                                      fresh_docs)

MODES = ("isolated", "blend-full", "isolated-host")
CHOICES = {"both": MODES[:2], "all": MODES, **{mode: (mode,) for mode in MODES}}
"""``--mode``: the modes each choice runs."""
COUNTERS = ("lookups", "hits", "misses", "evictions", "tokens_reused", "tokens_computed", "blend_lookups",
            "blend_hits", "blend_misses", "blend_tokens_reused", "blend_tokens_recomputed", "tier_hits",
            "tier_host_hits", "tier_host_drops")


# --- servers ----------------------------------------------------------------------------------

def mode_settings(mode: str, args, pool_tokens: int, max_chunk_len: int, host_bytes: int = 0) -> dict:
    gc = {"pool_tokens": pool_tokens, "max_chunks": max(8, args.docs_per_request[1]), "max_chunk_len": max_chunk_len,
          "separator": "##"}  # the trace's text prompts use the seeds' form
    if args.miss_budget:
        gc["miss_budget"] = args.miss_budget
    if mode in ISOLATED_MODES:
        gc["mode"] = "isolated"
        if mode == "isolated-host":
            gc["host_bytes"] = host_bytes
    else:
        gc.update(mode="blend", recompute_ratio=1.0)
    if args.eviction:
        gc["eviction"] = args.eviction
    return gc


# --- the run ------------------------------------------------------------------------------------

class Launched(NamedTuple):
    """A mode's server started but not waited for (``PressureSoak.launch``)."""
    server: VllmServer
    port: int
    settings: dict
    faults_off: Path  # the file whose existence stops the injected fill failures


class PressureSoak:
    def __init__(self, args, log=print):
        from vllm.utils.math_utils import cdiv

        self.args, self.log = args, log
        rng = random.Random(args.seed)
        self.model_path = H.resolve_model(args.model)
        self.tokenizer = H.load_tokenizer(self.model_path)
        self.corpus = build_corpus(self.tokenizer, args.docs + fresh_docs(args), tuple(args.doc_tokens), args.questions,
                                   tuple(args.question_words), rng)
        self.combos = build_combos(self.corpus, args, rng)
        self.trace = build_trace(self.corpus, self.combos, args, rng)
        self.encoder = BodyEncoder(self.tokenizer, str(self.model_path), args.max_tokens)
        bs = args.block_size
        # Sizes: the longest prompt (text prompts hold separators too), contexts, the pool.
        longest = max(len(self.tokenizer(self.encoder.text(p)).input_ids if not p.as_ids else self.encoder.ids(p)[0])
                      for body in self.trace for p in body.prompts)
        self.max_model_len = args.max_model_len or cdiv(longest + args.max_tokens + 8, bs) * bs
        if longest + args.max_tokens > self.max_model_len:
            raise SystemExit(f"prompts of up to {longest} tokens and {args.max_tokens} generated do not fit "
                             f"--max-model-len {self.max_model_len}")
        self.max_chunk_len = max(self.corpus.doc_tokens) + 8  # a text chunk holds its separator's tokens too
        contexts = [self.encoder.ids(Item(0, c.sys, tuple(self.corpus.docs[d] for d in c.doc_ids), "", True))[1][-1]
                    for c in self.combos]
        self.mean_context = sum(contexts) / len(contexts)
        minimum = (cdiv(self.max_model_len, bs) + 1 + cdiv(self.max_chunk_len, bs)) * bs
        self.pool_tokens = args.pool_tokens or max(minimum, cdiv(int(args.pool_contexts * self.mean_context), bs) * bs)
        self.pool_minimum = minimum
        per_token = H.kv_bytes_per_token(self.model_path, args.dtype)
        self.vllm_kv_tokens = cdiv(int(args.vllm_kv_seqs * self.max_model_len), bs) * bs
        self.kv_cache_bytes = args.kv_cache_bytes or (cdiv(self.pool_tokens, bs) * bs + self.vllm_kv_tokens) * per_token
        self.host_bytes = cdiv(int(args.host_contexts * self.mean_context), bs) * bs * per_token  # whole blocks
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="graphchunk-soak-pressure-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        flags = argparse.Namespace(**{**vars(args), "kv_cache_bytes": self.kv_cache_bytes,
                                      "max_model_len": self.max_model_len, "throughput_concurrency": 0})
        self.servers = Servers(self.model_path, flags, self.pool_tokens, self.max_chunk_len, self.log_dir, log)
        self.references: References | None = None

    def launch(self, mode: str) -> "Launched":
        """Starts the mode's server without waiting for it."""
        a = self.args
        port = free_port()
        settings = mode_settings(mode, a, self.pool_tokens, self.max_chunk_len, self.host_bytes)
        worker, env = "graphchunk.Runner", None
        faults_off = self.log_dir / f"faults-off-{mode}"
        if a.fail_fill_every > 0:  # graphchunk's worker that poisons pool entries (the repository on the path)
            worker = "perf.soak.fill_faults.FaultyRunner"
            faults_off.unlink(missing_ok=True)
            env = {EVERY_ENV: str(a.fail_fill_every), SEED_ENV: str(a.seed), OFF_ENV: str(faults_off),
                   "PYTHONPATH": os.pathsep.join(p for p in (str(H.REPO), os.environ.get("PYTHONPATH", "")) if p)}
        server = self.servers.launch(f"graphchunk-{mode}", worker, None, port, log_requests=True, settings=settings,
                                     env=env)
        return Launched(server, port, settings, faults_off)

    def run_mode(self, mode: str, launched: "Launched") -> dict:
        """The mode's traffic and checks on its launched server (``launch``), which it stops."""
        a = self.args
        server, port, settings, faults_off = launched
        self.servers.incarnation = mode
        self.servers.adopt(f"graphchunk-{mode}", server)
        estimates = Estimates()

        def new_client():
            client = BodyClient("127.0.0.1", port, self.encoder, estimates, a.request_timeout)
            client.miss_window = a.abort_misses_window
            return client

        started = time.monotonic()
        died = None
        try:
            dispatcher = Dispatcher(self.trace, [])
            threads = client_threads(dispatcher, a.concurrency, new_client, lambda: mode)
            last = time.monotonic()
            while dispatcher.wait(1.0) != "finished":
                if self.servers.died():
                    died = {"at_request": dispatcher.next, "code": server.process.returncode,
                            "log_tail": server.log_tail()}
                    self.log(f"[pressure] {mode}: the server died:\n{died['log_tail']}")
                    dispatcher.stop()
                if time.monotonic() - last > 30:
                    last = time.monotonic()
                    self.log(f"[pressure] {mode}: {dispatcher.done_count}/{len(self.trace)} "
                             f"{count_statuses(dispatcher.outcomes)}")
            for t in threads:
                t.join()
            wall = time.monotonic() - started
            outcomes = sorted(dispatcher.outcomes, key=lambda o: o.item.index)
            after = {}
            if died is None:
                faults_off.touch()
                drained = self.servers.drain()
                leaks = self.servers.read_leaks()
                final = self._final(new_client, mode)
                self.servers.drain()
                metrics = self.servers.metrics()
                after = {"drained": drained, "leaks": leaks, "final": final, "metrics": metrics,
                         "health": self.servers.health()}
        finally:
            if self.servers.current is not None:
                self.servers.stop()
        return self._report(mode, settings, outcomes, wall, died, after, server.log_path)

    def _final(self, new_client, mode: str) -> Outcome:
        """The final request (``_final_body``), once: one that read an entry poisoned before the
        faults stopped is planned again by the server itself and must complete."""
        client = new_client()
        final = client.run(self._final_body(), mode)
        client.close()
        return final

    def _final_body(self) -> Body:
        """After the traffic: the first combination's documents in reverse, as token ids."""
        combo, order = self.combos[0], tuple(reversed(self.combos[0].doc_ids))
        p = Item(-1, combo.sys, tuple(self.corpus.docs[d] for d in order), combo.questions[0], True, doc_ids=order)
        return Body(-1, p.sys, p.docs, p.question, p.as_ids, doc_ids=order, prompts=(p,), combos=(0,), tag="final")

    def check(self, mode: str, outcomes: list[Outcome]) -> dict:
        """Every completed prompt of ``outcomes`` against its reference."""
        if self.references is None:
            self.references = References(self.model_path, self.encoder, self.args.max_tokens, self.args.tie_tol)
        import torch

        refs = self.references
        seconds, computed = refs.seconds, dict(refs.computed)
        # One thread: on a small shared machine two OpenMP threads spin-wait on a busy core
        # (measured ~7x slower on the tiny model with another job running).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            found = self._check(mode, outcomes, refs, seconds)
        finally:
            torch.set_num_threads(threads)
        found["references_computed"] = {k: v - computed[k] for k, v in refs.computed.items()}
        return found

    def _check(self, mode: str, outcomes: list[Outcome], refs: References, seconds: float) -> dict:
        counts = {"checked": 0, "equal": 0, "wrong": 0, "near_ties": 0, "order_noise": 0}
        wrong, ties = [], []
        for outcome in outcomes:
            if outcome.status != "ok":
                continue
            for n, (item, (prompt_ids, got)) in enumerate(zip(outcome.item.prompts, outcome.choices)):
                v = refs.verdict(mode, item, prompt_ids, got)
                counts["checked"] += 1
                counts["order_noise"] += bool(v.get("order_noise"))
                where = {"index": outcome.item.index, "prompt": n, "batch": outcome.item.batch,
                         "salt": outcome.item.salt, "as_ids": item.as_ids, "docs": list(item.doc_ids), "got": got}
                if v["verdict"] == "equal":
                    counts["equal"] += 1
                elif v["verdict"] == "tie":
                    counts["near_ties"] += 1
                    ties.append({**where, **v})
                else:
                    counts["wrong"] += 1
                    wrong.append({**where, **v})
        return {**counts, "wrong_samples": wrong[:20], "ties": ties[:50],
                "reference_seconds": round(refs.seconds - seconds, 1)}

    def _report(self, mode, settings, outcomes, wall, died, after, log_path) -> dict:
        checks = self.check(mode, outcomes + ([after["final"]] if after.get("final") else []))
        final = after.get("final")
        final_verdict = None
        if final is not None and final.status == "ok":
            final_verdict = self.references.verdict(mode, final.item.prompts[0], final.prompt_ids,
                                                    final.token_ids)["verdict"]
        m = after.get("metrics", {})
        leaks = after.get("leaks", {})
        aborted = [o for o in outcomes if o.status == "aborted"]
        errors = [o for o in outcomes if o.status == "error"]
        ok = [o for o in outcomes if o.status == "ok"]
        counters = {name: int(m.get(f"vllm:graphchunk_{name}_total", 0)) for name in COUNTERS}
        log_text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
        refs_held, blocks_leaked = (leaks.get(n) for n in LEAK_GAUGES)
        faults = self.args.fail_fill_every > 0
        server_errors = error_lines(str(log_path), faults)
        injected = fill_faults(log_text)
        invariants = {
            "no_wrong": checks["wrong"] == 0 and checks["checked"] > 0,
            # No request fails, injected faults or not: a request whose copy read a poisoned entry
            # is planned again (fills_retried); no copy fails for another reason.
            "no_request_failed": died is None and not errors and injected["copies_failed_unexplained"] == 0 and
            int(m.get("vllm:graphchunk_requests_failed_total", 0)) == 0,
            "failed_copies_retried": not faults or injected["copies_failed"] == 0 or
            int(m.get("vllm:graphchunk_fills_retried_total", 0)) > 0,
            "no_refs_held_idle": refs_held == 0,
            "no_blocks_leaked_idle": blocks_leaked == 0,
            "kv_cache_given_back": leaks.get(KV_USAGE) == 0,
            "nothing_left_waiting": after.get("drained") is True,
            "evictions_happened": counters["evictions"] > 0,
            **({"host_hits_and_drops_happened": counters["tier_host_hits"] > 0 and counters["tier_host_drops"] > 0}
               if "host_bytes" in settings else {}),
            "server_alive_after": died is None and after.get("health") == 200 and final_verdict in ("equal", "tie"),
            "no_server_error_lines": server_errors["count"] == 0,
        }
        return {
            "mode": mode,
            "passed": all(invariants.values()),
            "requests": len(outcomes),
            "prompts": sum(len(o.item.prompts) for o in outcomes),
            "completed": len(ok),
            "completed_prompts": sum(len(o.item.prompts) for o in ok),
            "aborted": len(aborted),
            "aborts_by_kind": {kind: sum(o.kind == kind for o in aborted) for kind in PRESSURE_ACTIONS[1:]},
            "late_aborts": sum(o.status == "late" for o in outcomes),
            "aborts_failed_first": sum(o.status == "error" and o.item.action != "complete" for o in outcomes),
            "errors": len(errors) + (died is not None),
            "wrong": checks["wrong"],
            "near_ties": checks["near_ties"],
            "checked": checks["checked"],
            "batched_bodies": sum(bool(o.item.batch) for o in outcomes),
            "batched_bodies_completed": sum(bool(o.item.batch) for o in ok),
            "batched_by_form": {k: sum(o.item.batch == k for o in outcomes) for k in ("ids", "text")},
            "salted_bodies": sum(o.item.salt is not None for o in outcomes),
            "evictions": counters["evictions"],
            "hits": counters["hits"],
            "misses": counters["misses"],
            "tier_host_hits": counters["tier_host_hits"],
            "tier_host_drops": counters["tier_host_drops"],
            "hit_rate": H.ratio(counters["hits"], counters["lookups"]),
            "vllm_preemptions": int(m.get("vllm:num_preemptions_total", 0)),
            "pool_refs_held": refs_held,
            "pool_blocks_leaked": blocks_leaked,
            "kv_cache_usage_idle": leaks.get(KV_USAGE),
            "loads_dropped": int(m.get("vllm:graphchunk_loads_dropped_total", 0)),
            "entries_failed": int(m.get("vllm:graphchunk_entries_failed_total", 0)),
            "fills_retried": int(m.get("vllm:graphchunk_fills_retried_total", 0)),
            "requests_failed": int(m.get("vllm:graphchunk_requests_failed_total", 0)),
            "fill_faults": {"every": self.args.fail_fill_every, **injected},
            "invariants": invariants,
            "graphchunk_counters": counters,
            "pool_blocks_used_idle": m.get("vllm:graphchunk_pool_blocks_used"),
            "pool_blocks_total": m.get("vllm:graphchunk_pool_blocks_total"),
            "engine": {"requests_added": len(re.findall(r"Added request \S+\.", log_text)),
                       "requests_aborted": len(re.findall(r"Request \S+ aborted\.", log_text)),
                       "finished_by_reason": {r: int(m.get(f"vllm_finished_{r}", 0))
                                              for r in ("stop", "length", "abort", "error")},
                       "generation_tokens": int(m.get("vllm:generation_tokens_total", 0)),
                       "drained": after.get("drained")},
            "final_request": {"status": final.status if final else None, "verdict": final_verdict,
                              "error": final.error if final else None},
            "server_died": died,
            "server_error_lines": server_errors,
            "error_samples": [{"index": o.item.index, "action": o.item.action, "batch": o.item.batch,
                               "error": o.error} for o in errors[:20]],
            "check": checks,
            "graphchunk_settings": settings,
            "server_log": str(log_path),
            "wall_s": round(wall, 1),
            "requests_per_s": len(ok) / wall if wall else None,
        }

    def launch_all(self, modes: list[str]) -> dict[str, "Launched"]:
        """Every mode's server started at once (their start-ups overlap; the traffic runs one mode at
        a time, the other servers idle): a caller may start them ahead of ``run``."""
        return {mode: self.launch(mode) for mode in modes}

    def run(self, modes: list[str], command: str, launched: dict[str, "Launched"] | None = None) -> dict:
        """Every mode's traffic and checks, on the servers ``launch_all`` started (now if not given)."""
        a = self.args
        started = time.monotonic()
        self.log(f"[pressure] {len(self.trace)} bodies ({sum(len(b.prompts) for b in self.trace)} prompts) over "
                 f"{len(self.combos)} combinations of {len(self.corpus.docs)} documents; mean context "
                 f"{self.mean_context:.0f} tokens, pool {self.pool_tokens} tokens (start-up minimum "
                 f"{self.pool_minimum}), max_model_len {self.max_model_len}, KV cache {self.kv_cache_bytes} bytes")
        results = {}
        launched = dict(launched or self.launch_all(modes))
        try:
            for mode in modes:
                results[mode] = self.run_mode(mode, launched.pop(mode))
                r = results[mode]
                self.log(f"[pressure] {mode}: " + json.dumps({k: r[k] for k in SUMMARY}))
        finally:
            for left in launched.values():
                left.server.stop()
        return {
            "passed": all(r["passed"] for r in results.values()),
            "modes": results,
            "pool": {"pool_tokens": self.pool_tokens, "start_up_minimum_tokens": self.pool_minimum,
                     "mean_context_tokens": round(self.mean_context, 1),
                     "pool_over_mean_context": round(self.pool_tokens / self.mean_context, 2),
                     "vllm_kv_tokens": self.vllm_kv_tokens, "kv_cache_bytes": self.kv_cache_bytes,
                     "host_bytes": self.host_bytes if "isolated-host" in modes else None,
                     "max_model_len": self.max_model_len, "max_chunk_len": self.max_chunk_len},
            "trace": {"bodies": len(self.trace), "prompts": sum(len(b.prompts) for b in self.trace),
                      "combos": len(self.combos), "documents": len(self.corpus.docs),
                      "distinct_orders": len({(b.combos[0], p.doc_ids) for b in self.trace for p in b.prompts
                                              if b.action != "abort_misses"}),
                      "actions": {k: sum(b.action == k for b in self.trace) for k in PRESSURE_ACTIONS},
                      "concurrency": a.concurrency, "max_tokens": a.max_tokens},
            "wall_s": round(time.monotonic() - started, 1),
            "versions": H.versions(),
            "config": H.config_dict(a),
            "command": command,
        }


SUMMARY = ("passed", "requests", "completed", "aborted", "errors", "wrong", "near_ties", "checked",
           "batched_bodies", "evictions", "hits", "misses", "tier_host_hits", "tier_host_drops", "vllm_preemptions",
           "pool_refs_held",
           "pool_blocks_leaked", "kv_cache_usage_idle", "loads_dropped", "entries_failed", "wall_s")


# --- CLI ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="perf/soak/pressure.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=tuple(CHOICES), default="both")
    g = p.add_argument_group("model and server")
    g.add_argument("--model", default="smollm2", help="smollm2, tiny-llama3 (tiny-qwen2, tiny-qwen3) or a path")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--block-size", type=int, default=32)
    g.add_argument("--max-model-len", type=int, default=0, help="0: the longest prompt, max tokens and a little")
    g.add_argument("--max-num-batched-tokens", type=int, default=128)
    g.add_argument("--max-num-seqs", type=int, default=0, help="0: twice the concurrency")
    g.add_argument("--pool-tokens", type=int, default=0, help="0: --pool-contexts mean contexts, at least the "
                   "worker's start-up minimum")
    g.add_argument("--pool-contexts", type=float, default=2.0)
    g.add_argument("--host-contexts", type=float, default=4.0,
                   help="isolated-host: host memory below the pool in mean contexts (whole blocks of KV)")
    g.add_argument("--vllm-kv-seqs", type=float, default=1.5,
                   help="vLLM's own KV cache (beside the pool) in prompts of max_model_len")
    g.add_argument("--kv-cache-bytes", type=int, default=0, help="0: the pool plus --vllm-kv-seqs")
    g.add_argument("--eviction", default="", help="the pool's eviction policy ('': the server's default)")
    g.add_argument("--miss-budget", type=int, default=0,
                   help="graphchunk.miss_budget (0: the server's default; small: misses run over several steps)")
    g.add_argument("--startup-timeout", type=float, default=900.0)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--rss-interval", type=float, default=1.0)
    g.add_argument("--log-dir", default="", help="server logs ('': a fresh temp directory)")
    t = p.add_argument_group("trace")
    t.add_argument("--requests", type=int, default=500, help="request bodies per mode")
    t.add_argument("--concurrency", type=int, default=8)
    t.add_argument("--docs", type=int, default=24, help="documents in the corpus")
    t.add_argument("--doc-tokens", type=H.int_pair, default=(64, 160), help="LO,HI: document length (log-uniform)")
    t.add_argument("--docs-per-request", type=H.int_pair, default=(3, 4))
    t.add_argument("--combos", type=int, default=12, help="(sys prompt, document set) combinations")
    t.add_argument("--questions-per-combo", type=int, default=2)
    t.add_argument("--questions", type=int, default=32)
    t.add_argument("--question-words", type=H.int_pair, default=(6, 14))
    t.add_argument("--ids-fraction", type=float, default=0.7, help="single bodies sent as token ids + boundaries")
    t.add_argument("--batch-fraction", type=float, default=0.2, help="bodies carrying 2-4 prompts")
    t.add_argument("--salt-fraction", type=float, default=0.3, help="bodies with a tenant cache_salt")
    t.add_argument("--abort-stream", type=float, default=0.03)
    t.add_argument("--abort-prefill", type=float, default=0.03)
    t.add_argument("--abort-nostream", type=float, default=0.02)
    t.add_argument("--abort-misses", type=float, default=0.0,
                   help="share of bodies carrying documents no other request has, closed while their misses run")
    t.add_argument("--abort-misses-window", type=float, default=2.0,
                   help="abort_misses: seconds after the headers within which the client closes")
    t.add_argument("--fail-fill-every", type=int, default=0,
                   help="every Nth step that copies from the pool poisons one entry it copies first "
                        "(perf.soak.fill_faults.FaultyRunner; 0: none)")
    t.add_argument("--max-tokens", type=int, default=8)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tie-tol", type=float, default=1e-3, help="reference logprob gap below which a difference is a tie")
    p.add_argument("--out", type=Path, default=H.REPO / "perf/results/soak_pressure.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    H.script_env()
    modes = list(CHOICES[args.mode])
    result = PressureSoak(args).run(modes, H.command_line(__file__, argv))
    H.write_json(args.out, result)
    print(json.dumps({mode: {k: r[k] for k in SUMMARY} for mode, r in result["modes"].items()}, indent=1))
    if not result["passed"]:
        failed = {mode: [k for k, v in r["invariants"].items() if not v] for mode, r in result["modes"].items()}
        print(f"FAILED: {failed} (details in {args.out})", file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
