"""``bench_blend.py``'s engine and request loop: the engine's settings, the ``Runner`` that sends
one request at a time with graphchunk's counters around it, and ``run``: per prompt the vanilla
reference, every setting's warm-up and quality requests, then the timed rounds (the order and the
checks ``bench_blend.py``'s docstring describes)."""
from __future__ import annotations

import random
import time

import numpy as np

from graphchunk.metrics import COUNTERS  # every counter graphchunk exports

import harness as H
from blend_metrics import exact_match, full_logprobs, kl_divergence, step_argmaxes
from blend_task import NONCE_SYS, SYS_TEXT, Setting, build_tasks, prompt_sizes


# --- engine ---------------------------------------------------------------------------------------

def engine_kwargs(args, model_path: str, max_prompt: int) -> tuple[dict, dict, list[str]]:
    """(``vllm.LLM`` keyword arguments, model included; graphchunk's settings; notes)."""
    from vllm.utils.math_utils import cdiv, round_up

    from force_tokens import ForceTokens

    kv_per_token = H.kv_bytes_per_token(model_path, "float32")
    bs = args.block_size
    max_gen = max(args.continuation, args.answer_tokens)
    max_model_len = round_up(max_prompt + max_gen + 64, 256)
    # Pool: the current prompt's entries must survive until its timed requests (LRU evicts older
    # prompts'): per blend setting k chunk entries (own cache_salt each); isolated: (sys + k chunks)
    # for the quality sys, the warm-up sys and every timed round's new sys. Then x1.5.
    n_blend = sum(s.blend for s in args.settings)
    chunk_blocks = cdiv(64 + int(1.25 * args.doc_tokens) + 24, bs) + 1
    per_prompt = n_blend * args.docs * chunk_blocks + (args.repeats + 2) * (args.docs + 1) * chunk_blocks
    pool_tokens = args.pool_tokens or max(4096, int(1.5 * per_prompt) * bs)
    own_tokens = 4 * max_model_len
    kv_bytes = (pool_tokens + own_tokens) * kv_per_token
    kwargs = H.llm_kwargs(model_path, dtype="float32", block_size=bs, max_model_len=max_model_len, max_num_seqs=4,
                          kv_cache_bytes=kv_bytes, seed=args.seed, enforce_eager=args.enforce_eager,
                          max_logprobs=-1, logits_processors=[ForceTokens])
    graphchunk = dict(pool_tokens=pool_tokens, max_chunks=max(32, args.docs),
                      max_chunk_len=max(2048, 2 * args.doc_tokens))
    notes = [f"max_num_batched_tokens = max_model_len = {max_model_len} >= longest prompt {max_prompt} + "
             f"{max_gen} generated: every prefill runs in one step",
             f"kv_cache_memory_bytes = {int(kv_bytes)} ({kv_per_token} B/token fp32): chunk pool {pool_tokens} "
             f"tokens + {own_tokens} tokens for vLLM's own blocks",
             "max_logprobs=-1 so that logprobs=-1 (whole vocabulary) is accepted"]
    return kwargs, graphchunk, notes


class Runner:
    """Sends one request at a time, with counters and prefix-cache hits recorded."""

    def __init__(self, llm, args, log):
        self.llm, self.args, self.log = llm, args, log
        self.encoded: dict = {}
        self.failures: list[str] = []

    def encode(self, sys_text: str, docs: list[str], question: str):
        from graphchunk.llm import RagPrompt

        key = (sys_text, tuple(docs), question)
        if key not in self.encoded:
            self.encoded[key] = self.llm.encode(RagPrompt(sys_text, list(docs), question, chat=True))
        return self.encoded[key]

    def send(self, setting: Setting, sys_text, docs, question, params):
        from graphchunk.engine.frontend import BOUNDARIES_ARG

        ids, bounds = self.encode(sys_text, docs, question)
        prompt = {"prompt_token_ids": list(ids)}
        if not self.args.no_salt:
            prompt["cache_salt"] = f"bench-blend:{setting.label}"
        p = params.clone()
        extra = dict(p.extra_args or {})
        if setting.graphchunk:
            extra.update(setting.extra)
            extra[BOUNDARIES_ARG] = list(bounds)
        p.extra_args = extra or None
        before = self.llm.stats()
        out, wall = H.timed_generate(self.llm, prompt, p)
        delta = H.counter_delta(before, self.llm.stats(), COUNTERS)
        return out, wall, delta, ids, bounds


def nonzero(delta: dict) -> dict:
    return {k: v for k, v in delta.items() if v and not k.endswith("_seconds")}


# --- run ------------------------------------------------------------------------------------------

def run(args, log) -> dict:
    from vllm import SamplingParams

    model_path = str(H.resolve_model(args.model))
    tokenizer = H.load_tokenizer(model_path)
    vocab = len(tokenizer)
    rng = random.Random(args.seed)
    tasks = build_tasks(tokenizer, args, rng)
    nonces: set[str] = set()

    def fresh_sys() -> str:
        while True:
            nonce = "%06x" % rng.randrange(1 << 24)
            if nonce not in nonces:
                nonces.add(nonce)
                return NONCE_SYS.format(nonce)

    prompt_lens, doc_lens, max_prompt = prompt_sizes(tokenizer, tasks)
    kwargs, gc_cfg, notes = engine_kwargs(args, model_path, max_prompt)
    recorded = {k: v for k, v in kwargs.items() if k not in ("model", "logits_processors")}
    log(f"[bench_blend] {len(tasks)} prompts x {args.docs} documents; prompt tokens {min(prompt_lens)}..{max(prompt_lens)} "
        f"(mean {np.mean(prompt_lens):.0f}); document tokens {min(min(d) for d in doc_lens)}.."
        f"{max(max(d) for d in doc_lens)}; settings {[s.label for s in args.settings]}")
    log(f"[bench_blend] engine kwargs {recorded}; graphchunk {gc_cfg}")

    t0 = time.perf_counter()
    llm = H.make_engine("graphchunk", kwargs, gc_cfg)
    startup = time.perf_counter() - t0
    log(f"[bench_blend] engine up in {startup:.1f} s")
    runner = Runner(llm, args, log)
    bs = args.block_size
    n = args.continuation
    p_kl = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, flat_logprobs=True)
    p_ref = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
    p_answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0)
    p_time = H.ttft_params()
    per = {s.label: dict(kl=[], top1=[], first_agree=[], em=[], answers=[], same_answer=[], ttft=[],
                         ttft_same_sys=[], stats=dict(warm=[], quality=[], timed=[], timed_same_sys=[]),
                         cached_timed=[]) for s in args.settings}
    broken: dict[str, str] = {}
    reference = []
    try:
        for t in tasks:
            tp = time.perf_counter()
            canon = t.docs
            # vanilla reference: first-token distribution and greedy continuation
            vanilla = args.settings[0]
            out, wall, _, ids, bounds = runner.send(vanilla, SYS_TEXT, canon, t.question, p_kl)
            ref_lp = full_logprobs(out, vocab)
            out, _, _, _, _ = runner.send(vanilla, SYS_TEXT, canon, t.question, p_ref)
            cont = list(out.outputs[0].token_ids)
            if len(cont) != n:
                runner.failures.append(f"prompt {t.index}: vanilla continuation has {len(cont)} tokens, not {n}")
            if cont[0] != int(np.argmax(ref_lp)):
                runner.failures.append(f"prompt {t.index}: vanilla's first greedy token {cont[0]} is not the "
                                       f"argmax {int(np.argmax(ref_lp))} of its full logprobs")
            reference.append(dict(prompt=t.index, prompt_tokens=len(ids), boundaries=list(bounds),
                                  continuation=cont, continuation_text=tokenizer.decode(cont),
                                  first_request_s=wall))
            p_force = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1,
                                     extra_args={"force_tokens": cont})
            warm_sys = {}

            def quality(s: Setting) -> None:
                rec = per[s.label]
                walls = {}
                if s.graphchunk:  # documents into the pool: another order, another sys
                    warm_sys[s.label] = fresh_sys()
                    order = t.orders[0]
                    _, walls["warm"], delta, _, _ = runner.send(s, warm_sys[s.label], [canon[d] for d in order],
                                                                t.question, p_time)
                    rec["stats"]["warm"].append(delta)
                out, walls["kl"], d1, _, _ = runner.send(s, SYS_TEXT, canon, t.question, p_kl)
                kl = kl_divergence(ref_lp, full_logprobs(out, vocab))
                out, walls["forced"], d2, _, _ = runner.send(s, SYS_TEXT, canon, t.question, p_force)
                got = list(out.outputs[0].token_ids)
                if got != cont:
                    runner.failures.append(f"prompt {t.index} {s.label}: forcing failed, fed {got[:8]}... "
                                           f"instead of {cont[:8]}...")
                agree = [int(a == b) for a, b in zip(step_argmaxes(out), cont)]
                out, walls["answer"], d3, _, _ = runner.send(s, SYS_TEXT, canon, t.question, p_answer)
                text = out.outputs[0].text
                rec["kl"].append(kl)
                rec["top1"].append(agree)
                rec["first_agree"].append(agree[0] if agree else 0)
                rec["em"].append(int(exact_match(text, t.code)))
                rec["answers"].append(text)
                rec["same_answer"].append(int(text == per["vanilla"]["answers"][-1]) if s.graphchunk else 1)
                rec["stats"]["quality"].append({k: d1.get(k, 0) + d2.get(k, 0) + d3.get(k, 0) for k in d1})
                log(f"  prompt {t.index} {s.label:>18}: kl {kl:.3g}  top1 {np.mean(agree):.2f}  "
                    f"em {rec['em'][-1]}  {text!r:.50}  [{' '.join(f'{k} {v:.2f}s' for k, v in walls.items())}]")

            def timed(s: Setting, r: int, docs: list[str]) -> None:
                rec = per[s.label]
                out, wall, delta, ids, bounds = runner.send(s, fresh_sys(), docs, t.question, p_time)
                cached = out.num_cached_tokens or 0
                rec["ttft"].append(wall)
                rec["stats"]["timed"].append(delta)
                rec["cached_timed"].append(cached)
                check_timed(runner, t, s, delta, cached, args.docs, same_sys=False, sys_len=0, bs=bs)
                log(f"  prompt {t.index} round {r} {s.label:>18}: {1e3 * wall:8.1f} ms  cached={cached}"
                    + (f"  {nonzero(delta)}" if s.graphchunk else ""))
                if s.policy == "isolated":  # its own all-hit case: the warm-up's sys
                    out, wall, delta, ids, bounds = runner.send(s, warm_sys[s.label], docs, t.question, p_time)
                    cached = out.num_cached_tokens or 0
                    rec["ttft_same_sys"].append(wall)
                    rec["stats"]["timed_same_sys"].append(delta)
                    check_timed(runner, t, s, delta, cached, args.docs, same_sys=True, sys_len=bounds[0], bs=bs)
                    log(f"  prompt {t.index} round {r} {'isolated same sys':>18}: {1e3 * wall:8.1f} ms  "
                        f"cached={cached}  {nonzero(delta)}")

            def guarded(s: Setting, fn, *fn_args) -> None:
                """A setting whose request raises is reported and left out from then on (vanilla: fatal)."""
                if s.label in broken:
                    return
                try:
                    fn(s, *fn_args)
                except Exception as exc:  # noqa: BLE001
                    if not s.graphchunk:
                        raise
                    broken[s.label] = f"prompt {t.index}: {type(exc).__name__}: {exc}"
                    runner.failures.append(f"{s.label} failed and was dropped: {broken[s.label]}")
                    log(f"[bench_blend] {s.label} FAILED, dropped: {broken[s.label]}")
                    runner.llm.stats()  # raises too if the engine itself is gone

            for s in args.settings:
                guarded(s, quality)
            for r in range(args.repeats):
                docs = [canon[d] for d in t.orders[r + 1]]
                rot = r % len(args.settings)
                for s in args.settings[rot:] + args.settings[:rot]:
                    guarded(s, timed, r, docs)
            log(f"[bench_blend] prompt {t.index + 1}/{len(tasks)} done in {time.perf_counter() - tp:.1f} s "
                f"(elapsed {time.perf_counter() - t0:.0f} s)")
        final_stats = llm.stats()
    finally:
        H.shutdown(llm)
        del llm
    return dict(tasks=tasks, per=per, reference=reference, startup_s=startup, failures=runner.failures, broken=broken,
                engine=dict(llm_kwargs=recorded,
                            logits_processors=["force_tokens:ForceTokens"], graphchunk=gc_cfg, notes=notes,
                            model=model_path),
                final_stats=final_stats, prompt_tokens=prompt_lens, doc_tokens=doc_lens)


def check_timed(runner, t, s, delta, cached, k, *, same_sys, sys_len, bs) -> None:
    """A timed request: vLLM's prefix cache serves nothing (same-sys isolated: at most the sys
    prompt's whole blocks); blend and isolated same-sys hit every chunk, isolated new-sys misses all."""
    where = f"prompt {t.index} {s.label}{' same sys' if same_sys else ''}"
    limit = sys_len // bs * bs if same_sys else 0
    if cached > limit:
        runner.failures.append(f"{where}: vLLM prefix cache served {cached} tokens (allowed {limit})")
    if not s.graphchunk:
        if any(delta.get(key) for key in ("lookups", "hits", "misses")):
            runner.failures.append(f"{where}: graphchunk counters moved for an ordinary prompt: {delta}")
        return
    hit = s.blend or same_sys
    want = {"lookups": k, "hits": k if hit else 0, "misses": 0 if hit else k}
    got = {key: delta.get(key) for key in want}
    if got != want:
        runner.failures.append(f"{where}: counters {got}, expected {want}")
