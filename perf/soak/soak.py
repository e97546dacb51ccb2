"""Soak and faults: graphchunk behind vLLM's OpenAI server under concurrent RAG traffic.

    python -m perf.soak.soak [--model smollm2] [--requests 2000] [--concurrency 8] [--out perf/results/soak.json]

One run, in this order:

1. **Soak** (graphchunk's worker, isolated mode, a chunk pool much smaller than the working set,
   the persistent tier in a fresh directory or ``--store-path``). ``--concurrency``
   client threads replay a seeded trace over ``/v1/completions``: each request is
   ``sys ## doc ## ... ## question`` (text with separators, or ``--ids-fraction`` of them as token
   ids with explicit boundaries), its documents drawn by Zipf popularity from a corpus of CPython
   help-topic text, greedy, ``ignore_eos``, ``--max-tokens`` tokens. Faults:

   * client disconnects: ``abort_stream`` (streamed, the socket closed after the first token
     event: mid-decode), ``abort_prefill`` (streamed, closed after the response headers and
     before the first token event: queued or mid-prefill), ``abort_nostream`` (not streamed,
     closed before any response byte, after a random share of the typical latency);
   * a server restart at ``--restart-at`` of the trace: the clients pause, in-flight requests
     finish, a canary request with unseen documents writes its tier files, the server stops
     (SIGTERM), one of the canary's files is truncated (planted corruption), and a new server
     starts on the same port and tier directory. The canary is sent again (the truncated file
     must be reported as ``tier_rejected`` and recomputed, the intact one served from the tier);
   * a corrupted tier file planted while traffic runs, at ``--corrupt-at`` of the trace: bytes
     flipped in the payload of the canary's other file (by then served from the tier once). The
     canary is sent once more after the traffic (its entries long evicted from the small pool),
     and the server must reject that file and answer correctly.

   Afterwards: every in-flight request drained (vLLM's running/waiting gauges), a new request
   checked against the HF oracle (server alive and correct), the pool's accounting read from
   /metrics (``vllm:graphchunk_pool_refs_held`` and ``vllm:graphchunk_pool_blocks_leaked`` must be 0, and
   vLLM's ``vllm:kv_cache_usage_perc`` too: cancelled requests give their blocks back), the
   server process tree's RSS against its post-warm-up RSS (``--rss-factor``), the tier's bytes on
   disk against its budget. Then a sample of completed requests (``--check``; the canaries and
   the final request always) is checked token for token against ``graphchunk.reference.oracle`` (isolated
   mode, HF transformers): a mismatch counts as wrong unless the oracle's own logprob gap between
   its token and the server's at the first difference is below ``--tie-tol`` (a float near-tie,
   counted apart as ``near_ties``).

2. **Throughput** at a fixed concurrency (``--throughput-requests`` of the same trace, no faults):
   a fresh graphchunk server (same settings, fresh tier directory), then vanilla vLLM (vLLM's own
   worker, ``--enable-prefix-caching``, the same flags); requests/s and output tokens/s of each
   and their ratio.

Writes ``--out`` (JSON: the acceptance numbers, the raw numbers and the command) and exits 1 when
an invariant fails. The tier and the pool's leak gauges are required: a gauge the server does not
export fails its invariant.

This file runs the passes (``Soak``) and holds the command line. The roles it uses: from
``perf/common/`` (what the serving benches share too) ``trace`` (corpus, trace, request encoder),
``client`` (HTTP clients with their abort kinds, dispatcher), ``server`` (starting servers,
/metrics, RSS, tier files) and ``harness``; beside it ``faults`` (the planted tier faults and
their canary requests), ``check`` (the oracle comparison) and ``report`` (the result and its
invariants).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from graphchunk.tools.serve_demo import VllmServer, free_port
from perf.common import harness as H
from perf.soak.check import check
from perf.common.client import Client, Dispatcher, Estimates, Outcome, client_threads, count_statuses
from perf.soak.faults import Faults
from perf.soak.report import result, throughput_comparison, throughput_summary
from perf.common.server import Servers, tier_files
from perf.common.trace import Encoder, Item, build_corpus, build_trace, working_set_tokens


class Soak:
    """One run: the soak pass with its faults, the oracle check, the throughput passes, the result."""

    def __init__(self, args, log=print):
        self.args = args
        self.log = log
        self.rng = random.Random(args.seed)
        self.model_path = H.resolve_model(args.model)
        self.tokenizer = H.load_tokenizer(self.model_path)
        self.corpus = build_corpus(self.tokenizer, args.docs, tuple(args.doc_tokens), args.questions,
                                   tuple(args.question_words), self.rng)
        self.trace = build_trace(self.corpus, args, self.rng)
        self.encoder = Encoder(self.tokenizer, str(self.model_path), args.max_tokens)
        sys_tokens = {s: len(self.tokenizer.encode(s, add_special_tokens=False))
                      for s in self.corpus.systems}
        self.working_set = working_set_tokens(self.trace, self.corpus, sys_tokens)
        # A text chunk also holds its separator's tokens; a merge at either end may add one more.
        self.max_chunk_len = max(self.corpus.doc_tokens) + 8
        longest_prompt = max(len(self.encoder.ids(item)[0]) for item in self.trace)
        if longest_prompt + args.max_tokens + 8 * args.docs_per_request[1] > args.max_model_len:
            raise SystemExit(f"prompts of up to ~{longest_prompt} tokens and {args.max_tokens} generated do not fit "
                             f"--max-model-len {args.max_model_len}")
        from vllm.utils.math_utils import cdiv

        # graphchunk's start-up check: a pool holds a sys prompt of max_model_len and one chunk.
        bs = args.block_size
        minimum = (cdiv(args.max_model_len, bs) + 1 + cdiv(self.max_chunk_len, bs)) * bs
        self.pool_tokens = args.pool_tokens or max(int(self.working_set * args.pool_fraction), minimum)
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="graphchunk-soak-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.store_root = Path(args.store_path) if args.store_path else self.log_dir / "tier"
        self.servers = Servers(self.model_path, args, self.pool_tokens, self.max_chunk_len, self.log_dir, log)
        self.port = args.port or free_port()
        self.extra_outcomes: list[Outcome] = []
        """The tagged requests (canaries, final), checked against the oracle."""
        self.planted = Faults(self.servers, self.store_root, self.corpus.canary_docs, self.send, self.rng,
                              self.extra_outcomes, log)
        self.faults = self.planted.record
        self.rss_baseline_due: int | None = None
        self.estimates = Estimates()
        self.dispatcher: Dispatcher | None = None
        self.throughput_outcomes: dict[str, list[Outcome]] = {}

    def client(self) -> Client:
        return Client("127.0.0.1", self.port, self.encoder, self.estimates, self.args.request_timeout)

    def send(self, item: Item) -> Outcome:
        client = self.client()
        try:
            return client.run(item, self.servers.incarnation)
        finally:
            client.close()

    # --- faults and final checks (perf.soak.faults.Faults plants them) ---------------------------------

    def final_checks(self) -> dict:
        """After the traffic: canary once more (the live corruption), a new request, health."""
        self.planted.check_live()
        docs = (self.corpus.canary_docs[-1], self.corpus.docs[0], self.corpus.canary_docs[-2])
        outcome = self.send(Item(-1, self.corpus.systems[0], docs, self.corpus.questions[-1], False, tag="final"))
        self.extra_outcomes.append(outcome)
        return {"final_status": outcome.status, "server_process_alive": self.servers.current.process.poll() is None,
                "health": self.servers.health()}

    def restart(self) -> None:
        self.planted.restart(self.dispatcher.next, self.port)
        self.rss_baseline_due = self.dispatcher.done_count + self.args.warmup

    def corrupt_live(self) -> None:
        self.planted.corrupt_live(self.dispatcher.next)

    # --- passes ----------------------------------------------------------------------------------

    def traffic(self, items: list[Item], concurrency: int, barriers: dict[int, str],
                triggers: dict[int, str]) -> list[Outcome]:
        """Replays ``items`` with ``concurrency`` client threads; runs the fault named by
        ``barriers`` (drained) and ``triggers`` (live) when the trace reaches their index."""
        self.dispatcher = dispatcher = Dispatcher(items, list(barriers))
        pending_triggers = sorted(triggers.items())
        threads = client_threads(dispatcher, concurrency, self.client, lambda: self.servers.incarnation)
        try:
            last_report = time.monotonic()
            while True:
                state = dispatcher.wait(1.0)
                self._watch(dispatcher, pending_triggers)
                if state == "barrier":
                    getattr(self, barriers[dispatcher.next])()
                    dispatcher.resume()
                elif state == "finished":
                    break
                if time.monotonic() - last_report > 30:
                    last_report = time.monotonic()
                    self.log(f"[soak] {dispatcher.done_count}/{len(items)} done {count_statuses(dispatcher.outcomes)}")
        except BaseException:  # a fault failed (say, the restarted server never came up)
            dispatcher.stop()
            raise
        finally:
            for t in threads:
                t.join()
        return sorted(dispatcher.outcomes, key=lambda o: o.item.index)

    def _watch(self, dispatcher: Dispatcher, pending_triggers: list[tuple[int, str]]) -> None:
        """The main thread's rounds while traffic runs: a dead server, live faults, the RSS baseline."""
        if self.servers.died():
            server = self.servers.current
            self.log(f"[soak] the server died:\n{server.log_tail()}")
            self.faults["server_died"] = {"at_request": dispatcher.next, "code": server.process.returncode}
            dispatcher.stop()
        if pending_triggers and dispatcher.next >= pending_triggers[0][0]:
            _, name = pending_triggers.pop(0)
            getattr(self, name)()
        if self.rss_baseline_due is not None and dispatcher.done_count >= self.rss_baseline_due:
            self.servers.mark_rss_baseline()
            self.rss_baseline_due = None

    def launch(self) -> VllmServer:
        """The soak pass's server, started and not waited for (``run`` waits): a caller may start it
        ahead of ``run``."""
        return self.servers.launch("graphchunk-0", "graphchunk.Runner", self.store_root, self.port, log_requests=True)

    def soak(self, launched: VllmServer | None = None) -> dict:
        a = self.args
        n = len(self.trace)
        self.rss_baseline_due = a.warmup
        self.servers.adopt("graphchunk-0", launched or self.launch())
        self.servers.start_sampler()
        barriers = {int(a.restart_at * n): "restart"} if a.restart_at > 0 else {}
        triggers = {int(a.corrupt_at * n): "corrupt_live"} if a.corrupt_at > 0 else {}
        start = time.monotonic()
        try:
            outcomes = self.traffic(self.trace, a.concurrency, barriers, triggers)
            wall = time.monotonic() - start
            if "server_died" in self.faults:
                alive = {"server_process_alive": False}
            else:
                alive = self.final_checks()
                self.servers.end_incarnation()
            files = tier_files(self.store_root)
        finally:
            self.servers.stop_sampler()
            if self.servers.current is not None:
                self.servers.stop()
        return {"outcomes": outcomes, "wall_s": wall, "alive": alive, "tier_bytes": sum(files.values()),
                "tier_files": len(files)}

    def throughput(self, kind: str) -> dict:
        """One pass without faults on a fresh server: graphchunk's (fresh tier) or vanilla vLLM's."""
        a = self.args
        items = [dataclasses.replace(item, action="complete") for item in self.trace[:a.throughput_requests]]
        saved_port, self.port = self.port, free_port()
        self.servers.incarnation = f"{kind}-throughput"
        self.rss_baseline_due = None
        self.servers.start(f"{kind}-throughput", "graphchunk.Runner" if kind == "graphchunk" else None,
                           self.log_dir / "tier-throughput", self.port)
        try:
            warm = self.send(Item(-1, self.corpus.systems[0], (self.corpus.canary_docs[-3],), self.corpus.questions[0],
                                  False))
            if warm.status != "ok":
                raise RuntimeError(f"{kind} warm-up request failed: {warm.error}\n{self.servers.current.log_tail()}")
            m0 = self.servers.metrics()
            start = time.monotonic()
            outcomes = self.traffic(items, a.throughput_concurrency or a.concurrency, {}, {})
            wall = max(o.end for o in outcomes) - start
            self.servers.drain()
            m1 = self.servers.metrics()
        finally:
            self.servers.stop()
            self.port = saved_port
        self.throughput_outcomes[kind] = outcomes
        return throughput_summary(kind, len(items), outcomes, wall, m0, m1)

    def run(self, command: str, launched: VllmServer | None = None) -> dict:
        """All passes (the soak pass on ``launched``, if ``launch`` started it); the result
        (``perf.soak.report.result``)."""
        a = self.args
        started = time.monotonic()
        self.log(f"[soak] {len(self.trace)} requests over {len(self.corpus.docs)} documents, working set "
                 f"{self.working_set} tokens, pool {self.pool_tokens} tokens, tier {self.store_root}")
        soak = self.soak(launched)
        outcomes = soak["outcomes"]
        restart_at = self.faults.get("restart", {}).get("at_request", -1)
        checks = check(outcomes, self.extra_outcomes, restart_at, self.encoder, self.model_path, a)
        throughput = {}
        if a.throughput_requests > 0 and "server_died" not in self.faults:
            g, v = self.throughput("graphchunk"), self.throughput("vanilla")
            throughput = throughput_comparison(g, v, a.throughput_concurrency or a.concurrency, outcomes,
                                               self.throughput_outcomes["graphchunk"])
        found = result(self, command, outcomes, soak, checks, throughput, time.monotonic() - started)
        if not a.keep_tier and not a.store_path:  # tier directories this run made (GBs on SmolLM2)
            for name in ("tier", "tier-throughput"):
                shutil.rmtree(self.log_dir / name, ignore_errors=True)
        return found


# --- CLI ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="perf/soak/soak.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and server")
    g.add_argument("--model", default="smollm2", help="smollm2, tiny-llama3 (tiny-qwen2, tiny-qwen3) or a path")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--port", type=int, default=0, help="0: a free port (kept across the restart)")
    g.add_argument("--block-size", type=int, default=32)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="small: prompts prefill over several steps, so aborts land mid-prefill")
    g.add_argument("--max-num-seqs", type=int, default=0, help="0: twice the concurrency")
    g.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    g.add_argument("--pool-tokens", type=int, default=0, help="0: --pool-fraction of the trace's working set")
    g.add_argument("--pool-fraction", type=float, default=0.125)
    g.add_argument("--eviction", default="", help="graphchunk's pool eviction policy ('': the server's default)")
    g.add_argument("--store-path", default="", help="tier directory ('': a fresh one in the log directory)")
    g.add_argument("--store-bytes", type=int, default=0, help="tier budget (0: the server's default)")
    g.add_argument("--keep-tier", action="store_true", help="keep the tier directories this run made")
    g.add_argument("--startup-timeout", type=float, default=900.0)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--log-dir", default="", help="server logs and tier directory ('': a fresh temp directory)")
    t = p.add_argument_group("trace")
    t.add_argument("--requests", type=int, default=2000)
    t.add_argument("--concurrency", type=int, default=8)
    t.add_argument("--docs", type=int, default=120, help="documents in the corpus")
    t.add_argument("--doc-tokens", type=H.int_pair, default=(48, 320), help="LO,HI: document length (log-uniform)")
    t.add_argument("--docs-per-request", type=H.int_pair, default=(2, 5))
    t.add_argument("--questions", type=int, default=64)
    t.add_argument("--question-words", type=H.int_pair, default=(6, 16))
    t.add_argument("--zipf", type=float, default=1.1, help="popularity exponent s: P(rank r) ~ r^-s")
    t.add_argument("--ids-fraction", type=float, default=0.2, help="requests sent as token ids + boundaries")
    t.add_argument("--max-tokens", type=int, default=16)
    t.add_argument("--seed", type=int, default=0)
    f = p.add_argument_group("faults and checks")
    f.add_argument("--abort-stream", type=float, default=0.04, help="share of requests closed after the first token")
    f.add_argument("--abort-prefill", type=float, default=0.04, help="share closed after the headers, before a token")
    f.add_argument("--abort-nostream", type=float, default=0.03, help="share closed before any response byte")
    f.add_argument("--restart-at", type=float, default=0.5, help="share of the trace before the restart (0: none)")
    f.add_argument("--corrupt-at", type=float, default=0.75, help="share of the trace before the live corruption")
    f.add_argument("--check", type=int, default=100, help="completed requests checked against the oracle (-1: all)")
    f.add_argument("--tie-tol", type=float, default=1e-3, help="oracle logprob gap below which a difference is a tie")
    f.add_argument("--warmup", type=int, default=0, help="requests before the RSS baseline (0: a tenth of the trace)")
    f.add_argument("--rss-factor", type=float, default=1.5, help="final RSS may be at most this times the baseline")
    f.add_argument("--rss-interval", type=float, default=1.0)
    f.add_argument("--throughput-requests", type=int, default=400, help="0: no throughput comparison")
    f.add_argument("--throughput-concurrency", type=int, default=0, help="0: --concurrency")
    p.add_argument("--out", type=Path, default=H.REPO / "perf/results/soak.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    H.script_env()
    if args.warmup <= 0:
        args.warmup = max(1, args.requests // 10)
    result = Soak(args).run(H.command_line(__file__, argv))
    H.write_json(args.out, result)
    keys = ("requests", "wrong_outputs", "checked_outputs", "leaked_refs", "hit_rate", "tier_hits", "evictions",
            "aborts", "restarts", "throughput_over_vanilla", "passed")
    print(json.dumps({k: result[k] for k in keys}, indent=1))
    failed = [k for k, v in result["invariants"].items() if v is False]
    if failed:
        print(f"FAILED invariants: {', '.join(failed)} (details in {args.out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
