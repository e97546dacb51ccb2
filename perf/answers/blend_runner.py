"""``bench_blend.py``'s engine and request loop.

Contract: ``run(args, log) -> dict`` builds the tasks (``blend_task``) and one ``GraphChunkLLM``,
then per prompt sends, in this order, the vanilla reference, the warm-ups, every setting's forced
request (one batch), every setting's answer request (one batch) and the timed round(s), each
timed request alone (``bench_blend.py``'s docstring is the spec); it returns every per-prompt
measurement (``per[label]``), the references, the failures of its checks and the engine's
configuration. No statistics here (``blend_metrics``).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphchunk.metrics import COUNTERS  # every counter graphchunk exports

from perf.common import harness as H
from perf.answers.blend_metrics import kl_steps, step_logprobs
from perf.answers.blend_task import NONCE_SYS, SYS_TEXT, Setting, Task, build_tasks, prompt_sizes, salt_of
from perf.answers.rag_tasks import parse_docs


# --- engine ---------------------------------------------------------------------------------------

def engine_kwargs(args, model_path: str, max_prompt: int) -> tuple[dict, dict, list[str]]:
    """(``vllm.LLM`` keyword arguments, model included; graphchunk's settings; notes)."""
    from vllm.utils.math_utils import cdiv, round_up

    from perf.answers.force_tokens import ForceTokens

    kv_per_token = H.kv_bytes_per_token(model_path, "float32")
    bs, n, max_docs = args.block_size, len(args.settings), parse_docs(args.docs)[1]
    max_gen = max(args.continuation, args.answer_tokens)
    max_model_len = round_up(max_prompt + max_gen + 64, 256)
    # Pool (LRU): the current prompt's entries must survive until its timed requests: k chunk
    # entries per blend cache_salt; (sys + k chunks) per isolated cache_salt for the quality sys
    # and per isolated setting for every timed round's new sys. Then x1.5.
    salts = {salt_of(s) for s in args.settings if s.graphchunk}
    n_isolated = sum(s.policy == "isolated" for s in args.settings)
    chunk_blocks = cdiv(64 + int(1.25 * args.doc_tokens) + 24, bs) + 1
    per_prompt = (len(salts) + n_isolated * args.repeats) * (max_docs + 1) * chunk_blocks
    pool_tokens = args.pool_tokens or max(4096, int(1.5 * per_prompt) * bs)
    own_tokens = (n + 1) * max_model_len  # a batch of quality requests, one per setting, at once
    kv_bytes = (pool_tokens + own_tokens) * kv_per_token
    kwargs = H.llm_kwargs(model_path, dtype="float32", block_size=bs, max_model_len=max_model_len, max_num_seqs=n,
                          kv_cache_bytes=kv_bytes, seed=args.seed, enforce_eager=args.enforce_eager,
                          max_logprobs=-1, logits_processors=[ForceTokens], enable_chunked_prefill=False)
    graphchunk = dict(pool_tokens=pool_tokens, max_chunks=max(32, max_docs), eviction="lru",
                      max_chunk_len=max(2048, 2 * args.doc_tokens))
    if args.blend_entries == "context":
        graphchunk["blend_entries"] = args.blend_entries
    if args.blend_prefix:
        graphchunk["blend_prefix"] = args.blend_prefix
    notes = [f"max_num_batched_tokens = max_model_len = {max_model_len} >= longest prompt {max_prompt} + "
             f"{max_gen} generated, chunked prefill off: every prefill runs whole in one step, also in a batch "
             "(a blend policy selects among the chunk tokens of one step)",
             f"max_num_seqs = {n} settings: a quality batch runs at once; kv_cache_memory_bytes = {int(kv_bytes)} ({kv_per_token} B/token fp32): chunk pool {pool_tokens} "
             f"tokens + {own_tokens} tokens for vLLM's own blocks",
             "eviction lru: one prompt at a time, older prompts' entries are never used again, so the pool "
             "sized for the current prompt keeps it",
             "max_logprobs=-1 so that logprobs=-1 (whole vocabulary) is accepted"]
    return kwargs, graphchunk, notes


class Runner:
    """Sends requests (one, or one batch), with graphchunk's counters around them."""

    def __init__(self, llm, args):
        self.llm, self.args = llm, args
        self.encoded: dict = {}
        self.failures: list[str] = []

    def encode(self, sys_text: str, docs: list[str], question: str):
        from graphchunk.llm import RagPrompt

        key = (sys_text, tuple(docs), question)
        if key not in self.encoded:
            self.encoded[key] = self.llm.encode(RagPrompt(sys_text, list(docs), question, chat=True))
        return self.encoded[key]

    def request(self, setting: Setting, sys_text, docs, question, params):
        from graphchunk.engine.request_args import BOUNDARIES_ARG

        ids, bounds = self.encode(sys_text, docs, question)
        prompt = {"prompt_token_ids": list(ids)}
        if not self.args.no_salt and not (setting.blend and self.args.blend_entries == "corpus"):
            prompt["cache_salt"] = salt_of(setting)
        p = params.clone()
        extra = dict(p.extra_args or {})
        if setting.graphchunk:
            extra.update(setting.extra)
            extra[BOUNDARIES_ARG] = list(bounds)
        p.extra_args = extra or None
        return prompt, p, bounds

    def send_many(self, requests: list[tuple]) -> tuple[list, float, dict, list]:
        """(outputs, wall seconds, counter deltas, boundaries) of one ``generate`` of every request
        (setting, sys, docs, question, params); one request alone is timed as ``harness.timed_generate``."""
        built = [self.request(*r) for r in requests]
        before = self.llm.stats()
        if len(built) == 1:
            out, wall = H.timed_generate(self.llm, built[0][0], built[0][1])
            outs = [out]
        else:
            start = time.perf_counter()
            outs = self.llm.generate([b[0] for b in built], [b[1] for b in built], use_tqdm=False)
            wall = time.perf_counter() - start
        delta = H.counter_delta(before, self.llm.stats(), COUNTERS)
        return outs, wall, delta, [b[2] for b in built]

    def send(self, *request):
        outs, wall, delta, bounds = self.send_many([request])
        return outs[0], wall, delta, bounds[0]


def nonzero(delta: dict) -> dict:
    return {k: v for k, v in delta.items() if v and not k.endswith("_seconds")}


@dataclass
class Reference:
    """Vanilla's greedy continuation of a prompt, its distribution at every step ([steps, vocab])
    and the first answer-bearing step."""
    tokens: list[int]
    logprobs: np.ndarray
    answer_at: int


# --- run ------------------------------------------------------------------------------------------

class Bench:
    """One prompt at a time: ``prompt(task)`` sends its requests and records them in ``per``."""

    def __init__(self, args, log, llm, tokenizer):
        from vllm import SamplingParams

        self.args, self.log, self.tokenizer = args, log, tokenizer
        self.vocab = len(tokenizer)
        self.runner = Runner(llm, args)
        self.failures = self.runner.failures
        self.rng = random.Random(args.seed + 1)
        self.nonces: set[str] = set()
        # whole-vocabulary logprobs at every step; no detokenization (49k strings a step)
        self.p_ref = SamplingParams(max_tokens=args.continuation, temperature=0.0, ignore_eos=True, logprobs=-1,
                                    flat_logprobs=True, detokenize=False)
        self.p_answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0)
        self.p_time = H.ttft_params()
        self.per = {s.label: dict(quality=[], ttft=[], ttft_same_sys=[], cached_timed=[],
                                  stats=dict(warm=[], timed=[], timed_same_sys=[])) for s in args.settings}
        self.quality_stats: list[dict] = []  # per prompt: counters of the forced and the answer batch
        self.broken: dict[str, str] = {}
        self.reference: list[dict] = []
        self.warmed: dict[str, int] = {}  # cache_salt -> the last prompt whose warm-up it had

    def fresh_sys(self) -> str:
        while True:
            nonce = "%06x" % self.rng.randrange(1 << 24)
            if nonce not in self.nonces:
                self.nonces.add(nonce)
                return NONCE_SYS.format(nonce)

    def reference_of(self, t: Task) -> Reference:
        out, wall, _, bounds = self.runner.send(self.args.settings[0], SYS_TEXT, t.docs, t.question, self.p_ref)
        cont = list(out.outputs[0].token_ids)
        lp = step_logprobs(out, self.vocab)
        if len(cont) != self.args.continuation:
            self.failures.append(f"prompt {t.index}: vanilla continuation has {len(cont)} tokens, "
                                 f"not {self.args.continuation}")
        off = [j for j, tok in enumerate(cont) if lp[j, tok] < lp[j].max() - 1e-6]
        if off:
            self.failures.append(f"prompt {t.index}: vanilla's greedy tokens at steps {off} are not the argmax "
                                 "of its own full logprobs")
        at, fallback = t.answer_step(self.tokenizer, cont)
        self.reference.append(dict(prompt=t.index, kind=t.kind, prompt_tokens=len(out.prompt_token_ids),
                                   boundaries=list(bounds), continuation=cont,
                                   continuation_text=self.tokenizer.decode(cont), answer_position=at,
                                   answer_position_fallback=fallback, request_s=wall))
        return Reference(cont, lp, at)

    def warm_up(self, s: Setting, t: Task) -> None:
        """The documents into the pool, in another order, once per prompt and cache_salt: isolated
        behind the quality sys (its KV depends on sys, not on order), blend behind a fresh sys."""
        salt = salt_of(s)
        if not s.graphchunk or self.warmed.get(salt) == t.index:
            return
        sys_text = SYS_TEXT if s.policy == "isolated" else self.fresh_sys()
        _, wall, delta, _ = self.runner.send(s, sys_text, [t.docs[d] for d in t.orders[0]], t.question, self.p_time)
        self.per[s.label]["stats"]["warm"].append(delta)
        self.warmed[salt] = t.index
        self.log(f"  prompt {t.index} warm-up {s.label:>18}: {wall:.2f} s  {nonzero(delta)}")

    def batch(self, t: Task, settings: list[Setting], params_of, what: str) -> dict:
        """{label: output} of one request per setting, sent as one batch; if the batch raises,
        each alone (a setting whose request raises is dropped)."""
        requests = [(s, SYS_TEXT, t.docs, t.question, params_of(s)) for s in settings]
        try:
            outs, wall, delta, _ = self.runner.send_many(requests)
        except Exception as exc:  # noqa: BLE001
            self.log(f"[bench_blend] prompt {t.index} {what} batch failed ({type(exc).__name__}: {exc}); one by one")
            got = {}
            for r in requests:
                self.guarded(r[0], t, self.alone, r, got)
            return got
        self.quality_stats.append(dict(prompt=t.index, batch=what, wall_s=wall, counters=nonzero(delta)))
        self.log(f"  prompt {t.index} {what} batch of {len(requests)}: {wall:.2f} s  {nonzero(delta)}")
        return {s.label: out for s, out in zip(settings, outs)}

    def alone(self, s: Setting, t: Task, request: tuple, got: dict) -> None:
        got[s.label] = self.runner.send(*request)[0]

    def quality(self, t: Task, ref: Reference) -> None:
        live = [s for s in self.args.settings if s.label not in self.broken]
        p_force = self.p_ref.clone()
        p_force.extra_args = {"force_tokens": ref.tokens}
        forced = self.batch(t, live, lambda s: p_force, "forced")
        answers = self.batch(t, [s for s in live if s.label in forced], lambda s: self.p_answer, "answer")
        vanilla_answer = answers[self.args.settings[0].label].outputs[0].text
        for s in live:
            if s.label in answers:
                self.guarded(s, t, self.score, ref, forced[s.label], answers[s.label].outputs[0].text, vanilla_answer)

    def score(self, s: Setting, t: Task, ref: Reference, forced, text: str, vanilla_answer: str) -> None:
        got = list(forced.outputs[0].token_ids)
        if got != ref.tokens:
            self.failures.append(f"prompt {t.index} {s.label}: forcing failed, fed {got[:8]}... "
                                 f"instead of {ref.tokens[:8]}...")
        context_len = self.runner.encode(SYS_TEXT, t.docs, t.question)[1][-1]
        if s.graphchunk and forced.num_cached_tokens > context_len:  # the context: graphchunk's connector's
            self.failures.append(f"prompt {t.index} {s.label}: forced request served {forced.num_cached_tokens} "
                                 f"tokens, more than its context's {context_len}, by vLLM's prefix cache "
                                 "(another setting's blocks?)")
        lp = step_logprobs(forced, self.vocab)
        steps = min(len(lp), len(ref.logprobs))
        kl = kl_steps(ref.logprobs[:steps], lp[:steps])
        agree = (lp[:steps].argmax(axis=1) == np.asarray(ref.tokens[:steps])).astype(int)
        q = dict(prompt=t.index, kind=t.kind, kl=float(kl.mean()), kl_first=float(kl[min(ref.answer_at, steps - 1)]),
                 kl_first_token=float(kl[0]), top1_agreement=float(agree.mean()),
                 exact_match=int(t.correct(text)), same_answer=int(text == vanilla_answer),
                 kl_steps=[float(x) for x in kl], top1_steps=[int(a) for a in agree], answer=text)
        self.per[s.label]["quality"].append(q)
        self.log(f"  prompt {t.index} {t.kind:>7} {s.label:>18}: kl {q['kl']:.3g}  kl_first {q['kl_first']:.3g}  "
                 f"top1 {q['top1_agreement']:.2f}  em {q['exact_match']}  {text!r:.60}")

    def timed(self, s: Setting, t: Task, r: int, docs: list[str]) -> None:
        """New sys: every chunk a pool hit for blend, full prefill for vanilla, all miss for
        isolated; isolated also its all-hit case (the quality sys, its warm-up's)."""
        cases = [("timed", self.fresh_sys(), "ttft")]
        if s.policy == "isolated":
            cases.append(("timed_same_sys", SYS_TEXT, "ttft_same_sys"))
        for phase, sys_text, key in cases:
            out, wall, delta, bounds = self.runner.send(s, sys_text, docs, t.question, self.p_time)
            cached = out.num_cached_tokens or 0
            rec = self.per[s.label]
            rec[key].append(wall)
            rec["stats"][phase].append(delta)
            same = phase == "timed_same_sys"
            if not same:
                rec["cached_timed"].append(cached)
            check_timed(self.failures, t, s, delta, cached, len(t.docs), same_sys=same,
                        sys_len=bounds[0] if same else 0, bs=self.args.block_size, context_len=bounds[-1])
            self.log(f"  prompt {t.index} round {r} {s.label + (' same sys' if same else ''):>27}: "
                     f"{1e3 * wall:8.1f} ms  cached={cached}" + (f"  {nonzero(delta)}" if s.graphchunk else ""))

    def guarded(self, s: Setting, t: Task, fn, *fn_args) -> None:
        """A setting whose request raises is reported and left out from then on (vanilla: fatal)."""
        if s.label in self.broken:
            return
        try:
            fn(s, t, *fn_args)
        except Exception as exc:  # noqa: BLE001
            if not s.graphchunk:
                raise
            self.broken[s.label] = f"prompt {t.index}: {type(exc).__name__}: {exc}"
            self.failures.append(f"{s.label} failed and was dropped: {self.broken[s.label]}")
            self.log(f"[bench_blend] {s.label} FAILED, dropped: {self.broken[s.label]}")
            self.runner.llm.stats()  # raises too if the engine itself is gone

    def prompt(self, t: Task) -> None:
        settings = self.args.settings
        ref = self.reference_of(t)
        for s in settings:
            self.guarded(s, t, self.warm_up)
        self.quality(t, ref)
        for r in range(self.args.repeats):
            docs = [t.docs[d] for d in t.orders[r + 1]]
            rot = (t.index * self.args.repeats + r) % len(settings)  # who goes first moves on every round
            for s in settings[rot:] + settings[:rot]:
                self.guarded(s, t, self.timed, r, docs)


def run(args, log) -> dict:
    model_path = str(H.resolve_model(args.model))
    tokenizer = H.load_tokenizer(model_path)
    tasks = build_tasks(tokenizer, args, random.Random(args.seed))
    prompt_lens, doc_lens, max_prompt = prompt_sizes(tokenizer, tasks)
    kwargs, gc_cfg, notes = engine_kwargs(args, model_path, max_prompt)
    precomputed = None
    if args.blend_entries == "corpus":
        gc_cfg["store_path"], precomputed = precompute_corpus(args, model_path, tasks, log)
    recorded = {k: v for k, v in kwargs.items() if k not in ("model", "logits_processors")}
    log(f"[bench_blend] {len(tasks)} prompts x {args.docs} documents; prompt tokens {min(prompt_lens)}.."
        f"{max(prompt_lens)} (mean {np.mean(prompt_lens):.0f}); document tokens {min(min(d) for d in doc_lens)}.."
        f"{max(max(d) for d in doc_lens)}; settings {[s.label for s in args.settings]}")
    log(f"[bench_blend] engine kwargs {recorded}; graphchunk {gc_cfg}")
    t0 = time.perf_counter()
    llm = H.make_engine("graphchunk", kwargs, gc_cfg)
    startup = time.perf_counter() - t0
    log(f"[bench_blend] engine up in {startup:.1f} s")
    bench = Bench(args, log, llm, tokenizer)
    per_prompt_s = []
    try:
        for t in tasks:
            tp = time.perf_counter()
            bench.prompt(t)
            per_prompt_s.append(time.perf_counter() - tp)
            log(f"[bench_blend] prompt {t.index + 1}/{len(tasks)} done in {per_prompt_s[-1]:.1f} s "
                f"(elapsed {time.perf_counter() - t0:.0f} s)")
        final_stats = llm.stats()
    finally:
        H.shutdown(llm)
        del llm
    return dict(tasks=tasks, per=bench.per, reference=bench.reference, startup_s=startup, failures=bench.failures,
                broken=bench.broken, per_prompt_s=per_prompt_s, quality_batches=bench.quality_stats,
                engine=dict(llm_kwargs=recorded, logits_processors=["perf.answers.force_tokens:ForceTokens"], graphchunk=gc_cfg,
                            notes=notes, model=model_path),
                final_stats=final_stats, prompt_tokens=prompt_lens, doc_tokens=doc_lens, precomputed=precomputed)


def precompute_corpus(args, model_path: str, tasks: list[Task], log) -> tuple[str, dict]:
    """Every document of the run as the operator's corpus, its blend entries contextualized by
    ``graphchunk-precompute --context bm25`` (documents format, behind the quality sys) into
    ``--store`` (a temporary directory by default): (the store, what it ran and took)."""
    import json
    import tempfile

    from graphchunk.tools.precompute import main as precompute

    store = str(args.store or tempfile.mkdtemp(prefix="bench-blend-corpus-"))
    corpus = Path(store) / "corpus.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    documents = list(dict.fromkeys(d for t in tasks for d in t.docs))
    corpus.write_text("".join(json.dumps({"text": d, "mode": "blend"}) + "\n" for d in documents))
    argv = ["--model", model_path, "--store", store, "--corpus", str(corpus), "--format", "documents",
            "--sys", SYS_TEXT, "--dtype", "float32", "--block-size", str(args.block_size), "--context", "bm25",
            "--context-size", str(args.context_size)]
    log(f"[bench_blend] precomputing {len(documents)} documents behind their {args.context_size} most related "
        f"(BM25) into {store}")
    start = time.perf_counter()
    if precompute(argv) != 0:
        raise SystemExit("[bench_blend] graphchunk-precompute failed (its message is above)")
    return store, dict(documents=len(documents), seconds=time.perf_counter() - start,
                       command=["graphchunk-precompute", *argv])


def check_timed(failures, t, s, delta, cached, k, *, same_sys, sys_len, bs, context_len) -> None:
    """A timed request: vLLM's prefix cache serves nothing (same-sys isolated: at most the sys
    prompt's whole blocks), while a graphchunk request's whole context counts as cached (its
    connector supplies it: ``num_cached_tokens`` cannot tell the two apart, the counters can);
    blend and isolated same-sys hit every chunk, isolated new-sys misses all."""
    where = f"prompt {t.index} {s.label}{' same sys' if same_sys else ''}"
    limit = context_len if s.graphchunk else sys_len // bs * bs if same_sys else 0
    if cached > limit:
        failures.append(f"{where}: vLLM prefix cache served {cached} tokens (allowed {limit})")
    if not s.graphchunk:
        if any(delta.get(key) for key in ("lookups", "hits", "misses")):
            failures.append(f"{where}: graphchunk counters moved for an ordinary prompt: {delta}")
        return
    hit = s.blend or same_sys
    want = {"lookups": k, "hits": k if hit else 0, "misses": 0 if hit else k}
    got = {key: delta.get(key) for key in want}
    if got != want:
        failures.append(f"{where}: counters {got}, expected {want}")
