"""Quality and speed of every graphchunk setting against vanilla full prefill, side by side, in one run.

    python perf/bench_blend.py [--prompts 8 --docs 5 --doc-tokens 200 --continuation 16 --repeats 2
                                --settings all --out perf/results/blend_quality.json
                                --plot perf/results/blend_quality.png]     # ~17 min on 2 shared cores
    python perf/bench_blend.py --quick --settings vanilla,isolated          # smoke run, ~2 min

Settings (``--settings``, comma list, default all): vanilla, isolated, none, cacheblend:R, legolink:K.

One GraphChunkLLM engine (bundled SmolLM2-135M-Instruct, fp32, vLLM's compilation on as a user runs
it unless --enforce-eager, vLLM prefix caching on), one retrieval task, every setting on the same
token ids:

* ``vanilla``     the prompt's token ids as an ordinary token prompt (no boundaries): full prefill,
                  the reference;
* ``isolated``    graphchunk's isolated mode (``graphchunk_mode: isolated``);
* ``none`` / ``cacheblend:r`` / ``legolink:k``  blend mode (``graphchunk_mode: blend``,
                  ``graphchunk_recompute``, ``graphchunk_recompute_ratio`` / ``_tokens``);
                  ``cacheblend:1.0`` recomputes every chunk token and must match vanilla.

Task. Documents are CPython help-topic text (``pydoc_data.topics``, '#' removed), ~--doc-tokens
tokens each, whole sentences. Every prompt has --docs documents; one holds the planted fact "The
access code for the {color} {place} is {NNNN}." (at a random sentence boundary), up to
--distractors others hold the same fact for another color or place with another code. Chat form
(``RagPrompt(sys, docs, question, chat=True)``): system = sys, user = the documents and "What is
the access code for the {color} {place}?".

Per prompt, per setting (all requests greedy; each setting has its own ``cache_salt``, so no setting
is ever served KV another setting computed, neither by vLLM's prefix cache nor by the chunk pool):

* warm-up: the documents in another order behind another sys prompt (graphchunk settings only):
  afterwards every document is in the chunk pool;
* KL:      max_tokens=1, logprobs=-1 (the whole vocabulary, vLLM's raw model logprobs);
           kl = KL(vanilla || setting) of the first generated token's distribution, in nats;
* forced:  the setting is fed vanilla's greedy continuation (--continuation tokens, ignore_eos) by
           the ForceTokens logits processor (``force_tokens.py``) in one request; top-1 agreement =
           share of steps where the setting's own argmax (raw logprobs, rank 1) equals vanilla's token;
* answer:  free greedy generation (--answer-tokens, stops at EOS); exact match (EM) = the expected
           4-digit code occurs in the generated text as a whole number (regex ``(?<!\\d)CODE(?!\\d)``);
* timing (after all of the above, --repeats rounds, settings in rotated order each round): the
  documents in yet another order behind a sys prompt never seen before (a fresh nonce at its
  start, so vLLM's prefix cache cannot serve even its first block): every chunk is a pool hit for
  blend, a full prefill for vanilla, and an all-miss for isolated (isolated KV depends on sys).
  isolated also runs its own all-hit case: the warm-up's sys prompt (documents reordered, a first
  document no earlier request with that sys had). TTFT = wall time of ``generate`` with
  max_tokens=1; ``num_cached_tokens`` and graphchunk's counters are checked around every request.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
PERF = Path(__file__).resolve().parent
# The engine core may run in a spawned process: it must be able to import force_tokens too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PERF), os.environ.get("PYTHONPATH")) if p)
if str(PERF) not in sys.path:
    sys.path.insert(0, str(PERF))

import numpy as np  # noqa: E402

from bench_ttft import device_name, versions  # noqa: E402

REPO = PERF.parent
DEFAULT_SETTINGS = ("vanilla,isolated,none,cacheblend:0.05,cacheblend:0.15,cacheblend:0.3,"
                    "legolink:1,legolink:4,legolink:16,cacheblend:1.0")
try:  # every counter graphchunk exports (blend's blend_tokens_recomputed etc. where present)
    from graphchunk.metrics import COUNTERS  # noqa: E402
except ImportError:  # pragma: no cover
    COUNTERS = ("lookups", "hits", "misses", "evictions", "tokens_reused", "tokens_computed")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown")
PLACES = ("kitchen", "library", "garage", "basement", "office", "studio", "warehouse", "workshop",
          "greenhouse", "attic")
FULL_KL_TOL = 1e-4
"""cacheblend r=1 must match vanilla: mean first-token KL at most this (vanilla vs itself: ~1e-7)."""
SYS_TEXT = "You are a helpful assistant. Answer the question using the documents."
EM_RULE = ("exact_match = 1 if the expected 4-digit code occurs in the setting's free greedy answer "
           "(detokenized text of at most --answer-tokens tokens, generation stopped at EOS) as a whole "
           "number, i.e. re.search(r'(?<!\\d)CODE(?!\\d)', text); the mean over prompts")


# --- settings -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    label: str
    policy: str  # vanilla, isolated, none, cacheblend, legolink
    param: float
    extra: dict | None  # graphchunk extra_args; None: an ordinary prompt

    @property
    def graphchunk(self) -> bool:
        return self.extra is not None

    @property
    def blend(self) -> bool:
        return self.policy in ("none", "cacheblend", "legolink")


def parse_settings(spec: str) -> list[Setting]:
    out = []
    for item in (DEFAULT_SETTINGS if spec == "all" else spec).split(","):
        item = item.strip()
        if not item:
            continue
        name, _, value = item.partition(":")
        if name == "vanilla":
            out.append(Setting("vanilla", "vanilla", 0, None))
        elif name == "isolated":
            out.append(Setting("isolated", "isolated", 0, {"graphchunk_mode": "isolated"}))
        elif name == "none":
            out.append(Setting("blend none", "none", 0,
                               {"graphchunk_mode": "blend", "graphchunk_recompute": "none"}))
        elif name == "cacheblend":
            r = float(value)
            out.append(Setting(f"cacheblend r={r:g}", "cacheblend", r,
                               {"graphchunk_mode": "blend", "graphchunk_recompute": "cacheblend",
                                "graphchunk_recompute_ratio": r}))
        elif name == "legolink":
            k = int(value)
            out.append(Setting(f"legolink k={k}", "legolink", k,
                               {"graphchunk_mode": "blend", "graphchunk_recompute": "legolink",
                                "graphchunk_recompute_tokens": k}))
        else:
            raise SystemExit(f"unknown setting {item!r}; known: vanilla, isolated, none, cacheblend:R, legolink:K")
    if not out or out[0].policy != "vanilla":  # the reference always runs, and first
        out = [Setting("vanilla", "vanilla", 0, None)] + [s for s in out if s.policy != "vanilla"]
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"duplicate settings in {spec!r}")
    return out


# --- task -----------------------------------------------------------------------------------------

def corpus_paragraphs() -> list[str]:
    """Paragraphs of CPython's help topics, as the tests read them (``reference.text``)."""
    from graphchunk.reference.text import help_paragraphs

    return help_paragraphs()


SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class Task:
    index: int
    docs: list[str]  # canonical order
    color: str
    place: str
    code: str
    gold: int  # index of the document holding the fact
    distractors: list[dict]
    question: str
    orders: list[list[int]] = field(default_factory=list)  # [warm-up, timed round 1..R]


def build_tasks(tokenizer, args, rng: random.Random) -> list[Task]:
    paragraphs = corpus_paragraphs()
    starts = list(range(len(paragraphs)))
    rng.shuffle(starts)
    used: set[int] = set()
    seen_heads: set[str] = set()
    lo, hi = int(0.75 * args.doc_tokens), int(1.25 * args.doc_tokens)
    ntok = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731

    def document() -> list[str]:
        """Whole sentences from consecutive unused paragraphs, lo..hi tokens."""
        while starts:
            p = starts.pop()
            if p in used or paragraphs[p][:80] in seen_heads:
                continue
            q, text = p, ""
            while q < len(paragraphs) and q not in used and ntok(text) < lo:
                text = (text + " " + paragraphs[q]).strip()
                q += 1
            sentences, kept = SENTENCE_END.split(text), []
            for s in sentences:
                if ntok(" ".join(kept + [s])) > hi:
                    break
                kept.append(s)
            if ntok(" ".join(kept)) < lo:
                continue
            used.update(range(p, q))
            seen_heads.add(paragraphs[p][:80])
            return kept
        raise SystemExit("the corpus has too few distinct documents for this workload; lower --prompts/--docs")

    def plant(sentences: list[str], fact: str) -> str:
        at = rng.randint(0, len(sentences))
        return " ".join(sentences[:at] + [fact] + sentences[at:])

    tasks = []
    codes_used: set[str] = set()

    def new_code() -> str:
        while True:
            c = str(rng.randint(1000, 9999))
            if c not in codes_used:
                codes_used.add(c)
                return c

    for i in range(args.prompts):
        k = args.docs
        color, place = rng.choice(COLORS), rng.choice(PLACES)
        code = new_code()
        slots = list(range(k))
        rng.shuffle(slots)
        gold, distractor_slots = slots[0], slots[1:1 + min(args.distractors, k - 1)]
        raw = [document() for _ in range(k)]
        docs = [" ".join(s) for s in raw]
        docs[gold] = plant(raw[gold], f"The access code for the {color} {place} is {code}.")
        distractors = []
        for j, slot in enumerate(distractor_slots):
            other_c = rng.choice([c for c in COLORS if c != color])
            other_p = rng.choice([p for p in PLACES if p != place])
            c2, p2 = [(other_c, place), (color, other_p), (other_c, other_p)][j % 3]
            code2 = new_code()
            docs[slot] = plant(raw[slot], f"The access code for the {c2} {p2} is {code2}.")
            distractors.append({"doc": slot, "color": c2, "place": p2, "code": code2})
        # Warm-up and timed orders: each with a first document that was first in no earlier order
        # (canonical included), as long as there are enough documents.
        firsts = [0]
        orders = []
        for _ in range(args.repeats + 1):
            fresh = [d for d in range(k) if d not in firsts] or list(range(1, k)) or [0]
            first = rng.choice(fresh)
            firsts.append(first)
            rest = [d for d in range(k) if d != first]
            rng.shuffle(rest)
            orders.append([first] + rest)
        tasks.append(Task(i, docs, color, place, code, gold, distractors,
                          f"What is the access code for the {color} {place}?", orders))
    return tasks


# --- engine ---------------------------------------------------------------------------------------

def engine_kwargs(args, model_path: str, max_prompt: int) -> tuple[dict, dict, list[str]]:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4  # fp32
    bs = args.block_size
    max_gen = max(args.continuation, args.answer_tokens)
    max_model_len = -(-(max_prompt + max_gen + 64) // 256) * 256
    # Pool: the current prompt's entries must survive until its timed requests (LRU evicts older
    # prompts'): per blend setting k chunk entries (own cache_salt each); isolated: (sys + k chunks)
    # for the quality sys, the warm-up sys and every timed round's new sys. Then x1.5.
    n_blend = sum(s.blend for s in args.settings)
    chunk_blocks = -(-(64 + int(1.25 * args.doc_tokens) + 24) // bs) + 1
    per_prompt = n_blend * args.docs * chunk_blocks + (args.repeats + 2) * (args.docs + 1) * chunk_blocks
    pool_tokens = args.pool_tokens or max(4096, int(1.5 * per_prompt) * bs)
    own_tokens = 4 * max_model_len
    kv_bytes = (pool_tokens + own_tokens) * kv_per_token
    from force_tokens import ForceTokens

    kwargs = dict(dtype="float32", enforce_eager=args.enforce_eager, enable_prefix_caching=True, block_size=bs,
                  max_model_len=max_model_len, max_num_batched_tokens=max_model_len, max_num_seqs=4,
                  kv_cache_memory_bytes=int(kv_bytes), seed=args.seed, max_logprobs=-1,
                  logits_processors=[ForceTokens])
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
        gc.collect()
        start = time.perf_counter()
        out = self.llm.generate([prompt], p)[0]
        wall = time.perf_counter() - start
        after = self.llm.stats()
        delta = {k: (round(after[k] - before[k], 6) if k == "lookup_seconds" else int(after[k] - before[k]))
                 for k in COUNTERS if k in after and k in before}
        return out, wall, delta, ids, bounds


def nonzero(delta: dict) -> dict:
    return {k: v for k, v in delta.items() if v and k != "lookup_seconds"}


def full_logprobs(out, vocab: int) -> np.ndarray:
    """The first generated position's logprobs over the whole vocabulary (flat_logprobs)."""
    lp = out.outputs[0].logprobs
    s, e = lp.start_indices[0], lp.end_indices[0]
    arr = np.full(vocab, -np.inf)
    arr[np.asarray(lp.token_ids[s:e], dtype=np.int64)] = np.asarray(lp.logprobs[s:e], dtype=np.float64)
    return arr


def kl_divergence(ref: np.ndarray, other: np.ndarray) -> float:
    p = np.exp(ref)
    mask = p > 0
    with np.errstate(invalid="ignore"):
        terms = p[mask] * (ref[mask] - other[mask])
    return float(np.sum(terms)) if np.all(np.isfinite(terms)) else float("inf")


def step_argmaxes(out) -> list[int]:
    """The model's own top-1 token (rank 1 of the raw logprobs) at every generated step."""
    tops = []
    for position in out.outputs[0].logprobs:
        best = [tid for tid, lp in position.items() if lp.rank == 1]
        tops.append(best[0] if best else max(position.items(), key=lambda kv: kv[1].logprob)[0])
    return tops


def exact_match(text: str, code: str) -> bool:
    return re.search(rf"(?<!\d){code}(?!\d)", text) is not None


# --- run ------------------------------------------------------------------------------------------

def run(args, log) -> dict:
    import transformers
    from vllm import SamplingParams

    from graphchunk import GraphChunkLLM
    from graphchunk.reference import models

    model_path = args.model or str(models.smollm2_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    vocab = len(tokenizer)
    rng = random.Random(args.seed)
    tasks = build_tasks(tokenizer, args, rng)
    nonces: set[str] = set()

    def fresh_sys() -> str:
        while True:
            nonce = "%06x" % rng.randrange(1 << 24)
            if nonce not in nonces:
                nonces.add(nonce)
                return f"Session {nonce}. {SYS_TEXT}"

    # Prompt and document lengths before the engine exists (GraphChunkLLM.encode needs only a tokenizer).
    from graphchunk.llm import RagPrompt

    probe = GraphChunkLLM.__new__(GraphChunkLLM)
    probe.tokenizer = tokenizer
    encoded = [probe.encode(RagPrompt(SYS_TEXT, t.docs, t.question, chat=True)) for t in tasks]
    prompt_lens = [len(ids) for ids, _ in encoded]
    doc_lens = [[b - a for a, b in zip(bounds[:-1], bounds[1:])] for _, bounds in encoded]
    longest_sys = probe.encode(RagPrompt(f"Session ffffff. {SYS_TEXT}", ["x"], "q", chat=True))[1][0]
    max_prompt = max(prompt_lens) - encoded[0][1][0] + longest_sys + 8  # a nonce sys instead of SYS_TEXT
    kwargs, gc_cfg, notes = engine_kwargs(args, model_path, max_prompt)
    log(f"[bench_blend] {len(tasks)} prompts x {args.docs} documents; prompt tokens {min(prompt_lens)}..{max(prompt_lens)} "
        f"(mean {np.mean(prompt_lens):.0f}); document tokens {min(min(d) for d in doc_lens)}.."
        f"{max(max(d) for d in doc_lens)}; settings {[s.label for s in args.settings]}")
    log(f"[bench_blend] engine kwargs {({k: v for k, v in kwargs.items() if k != 'logits_processors'})}; "
        f"graphchunk {gc_cfg}")

    t0 = time.perf_counter()
    llm = GraphChunkLLM(model_path, graphchunk=gc_cfg, **kwargs)
    startup = time.perf_counter() - t0
    log(f"[bench_blend] engine up in {startup:.1f} s")
    runner = Runner(llm, args, log)
    bs = args.block_size
    n = args.continuation
    p_kl = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, flat_logprobs=True)
    p_ref = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
    p_answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0)
    p_time = SamplingParams(max_tokens=1, temperature=0.0)
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
        llm.shutdown()
        del llm
        gc.collect()
    return dict(tasks=tasks, per=per, reference=reference, startup_s=startup, failures=runner.failures, broken=broken,
                engine=dict(llm_kwargs={k: v for k, v in kwargs.items() if k != "logits_processors"},
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


# --- summary --------------------------------------------------------------------------------------

def summed(deltas: list[dict]) -> dict:
    keys = sorted({k for d in deltas for k in d})
    return {k: int(sum(d.get(k, 0) for d in deltas)) for k in keys}


def _stat(fn, values):
    return float(fn(values)) if len(values) else None


def rows(args, res) -> list[dict]:
    out = []
    full_prefill_ms = _stat(np.median, np.asarray(res["per"][args.settings[0].label]["ttft"]) * 1e3)  # vanilla's p50
    for s in args.settings:
        per = res["per"][s.label]
        steps = [a for agree in per["top1"] for a in agree]
        ttft = np.asarray(per["ttft"]) * 1e3
        p50 = lambda v: np.percentile(v, 50)  # noqa: E731
        p90 = lambda v: np.percentile(v, 90)  # noqa: E731
        row = dict(policy=s.policy, param=s.param, label=s.label, extra_args=s.extra,
                   kl=_stat(np.mean, per["kl"]), kl_median=_stat(np.median, per["kl"]), kl_max=_stat(np.max, per["kl"]),
                   top1_agreement=_stat(np.mean, steps), first_token_agreement=_stat(np.mean, per["first_agree"]),
                   exact_match=_stat(np.mean, per["em"]), same_answer_as_vanilla=_stat(np.mean, per["same_answer"]),
                   ttft_ms=_stat(p50, ttft), ttft_p90_ms=_stat(p90, ttft),
                   n_prompts=len(per["kl"]), n_timed=int(ttft.size), n_continuation_steps=len(steps),
                   failed=res["broken"].get(s.label))
        if s.policy == "isolated":
            same = np.asarray(per["ttft_same_sys"]) * 1e3
            row.update(ttft_ms_new_sys=row["ttft_ms"], ttft_ms_same_sys_all_hit=_stat(p50, same),
                       ttft_p90_ms_same_sys_all_hit=_stat(p90, same),
                       ttft_note="ttft_ms = ttft_ms_new_sys: documents cached under another sys prompt, the timed "
                                 "request's sys never seen, so every isolated chunk misses (sys + chunks + question "
                                 "computed); ttft_ms_same_sys_all_hit: the sys of the warm-up request, documents "
                                 "reordered, every chunk a pool hit (question computed only)")
        row["ttft_over_full_prefill"] = (row["ttft_ms"] / full_prefill_ms
                                         if row["ttft_ms"] is not None and full_prefill_ms else None)
        counters = {phase: summed(ds) for phase, ds in per["stats"].items() if ds}
        timed = per["stats"]["timed"]
        if timed:
            counters["timed_mean_per_request"] = {k: v / len(timed) for k, v in summed(timed).items()}
        row["counters"] = counters
        row["counters_note"] = ("deltas of llm.stats() summed per phase: warm (one per prompt), quality (KL + "
                                "forced + answer requests; vLLM's prefix cache serves most of the 2nd and 3rd), "
                                "timed (all rounds, new sys)" + (", timed_same_sys" if s.policy == "isolated" else ""))
        row["per_prompt"] = dict(kl=per["kl"], top1_agreement=[float(np.mean(a)) for a in per["top1"]],
                                 top1_steps=per["top1"], exact_match=per["em"], answers=per["answers"],
                                 ttft_ms=[float(x) for x in ttft], num_cached_tokens_timed=per["cached_timed"])
        if s.policy == "isolated":
            row["per_prompt"]["ttft_ms_same_sys_all_hit"] = [1e3 * x for x in per["ttft_same_sys"]]
        out.append(row)
    return out


def plot(result_rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-7
    fig, (ax_kl, ax_top) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    for row in result_rows:
        if row["kl"] is None or row["ttft_ms"] is None:
            continue
        x = row["ttft_ms"]
        marker = {"vanilla": "*", "isolated": "s", "none": "X", "cacheblend": "o", "legolink": "^"}[row["policy"]]
        for ax, y in ((ax_kl, max(row["kl"], floor)), (ax_top, row["top1_agreement"])):
            ax.plot([x], [y], marker, markersize=9)
            ax.annotate(row["label"] + (" (new sys)" if row["policy"] == "isolated" else ""), (x, y),
                        textcoords="offset points", xytext=(5, 4), fontsize=7)
        if row["policy"] == "isolated" and row["ttft_ms_same_sys_all_hit"] is not None:
            x2 = row["ttft_ms_same_sys_all_hit"]
            for ax, y in ((ax_kl, max(row["kl"], floor)), (ax_top, row["top1_agreement"])):
                ax.plot([x2], [y], "s", mfc="none", markersize=9, color="gray")
                ax.annotate("isolated (same sys, all hit)", (x2, y), textcoords="offset points",
                            xytext=(5, -10), fontsize=7)
    ax_kl.set_yscale("log")
    ax_top.set_xscale("log")
    ax_kl.set_ylabel(f"KL(vanilla || setting), first token, nats (floor {floor:g})")
    ax_top.set_ylabel("top-1 agreement, teacher-forced continuation")
    ax_top.set_xlabel("TTFT p50, ms (documents cached, unseen sys prompt)")
    lowest = min(r["top1_agreement"] for r in result_rows if r["top1_agreement"] is not None)
    ax_top.set_ylim(max(0.0, lowest - 0.05), 1.01)
    for ax in (ax_kl, ax_top):
        ax.grid(True, which="both", alpha=0.3)
    ax_kl.set_title(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--docs", type=int, default=5, help="documents per prompt")
    p.add_argument("--doc-tokens", type=int, default=200, help="target tokens per document (0.75x..1.25x)")
    p.add_argument("--distractors", type=int, default=2, help="documents with a fact for another color/place")
    p.add_argument("--continuation", type=int, default=16, help="teacher-forced steps (vanilla's greedy output)")
    p.add_argument("--answer-tokens", type=int, default=24, help="free greedy tokens scored for exact match")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per prompt")
    p.add_argument("--settings", default="all", help=f"comma list; all = {DEFAULT_SETTINGS}")
    p.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    p.add_argument("--pool-tokens", type=int, default=0, help="0: sized from the workload")
    p.add_argument("--no-salt", action="store_true",
                   help="no per-setting cache_salt (settings may then share vLLM prefix-cache blocks and pool entries)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true",
                   help="run vLLM eagerly (default: vLLM's compilation on, as users run it)")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--out", type=Path, default=REPO / "perf/results/blend_quality.json")
    p.add_argument("--replot", type=Path, default=None, help="only draw --plot again from this result JSON")
    p.add_argument("--plot", type=Path, default=REPO / "perf/results/blend_quality.png")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: 2 prompts x 3 documents of ~80 tokens, "
                                                        "1 round (explicitly given sizes still win)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.quick:
        given = {a.split("=")[0] for a in raw if a.startswith("--")}
        for name, value in (("prompts", 2), ("docs", 3), ("doc_tokens", 80), ("repeats", 1), ("distractors", 1),
                            ("answer_tokens", 16)):
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    args.settings = parse_settings(args.settings)
    return args


def print_table(result_rows: list[dict]) -> None:
    print(f"\n{'setting':>20} {'KL mean':>10} {'top-1':>7} {'EM':>6} {'TTFT p50 ms':>12}  per timed request: "
          "tokens_computed [+ blend_tokens_recomputed]")
    for row in result_rows:
        if row["kl"] is None or row["ttft_ms"] is None:
            print(f"{row['label']:>20}  no result: {row['failed']}")
            continue
        mean = row["counters"].get("timed_mean_per_request", {})
        work = "" if "tokens_computed" not in mean else f"{mean['tokens_computed']:.0f}"
        if work and row["policy"] not in ("vanilla", "isolated") and "blend_tokens_recomputed" in mean:
            work += f" + {mean['blend_tokens_recomputed']:.0f}"
        print(f"{row['label']:>20} {row['kl']:>10.3g} {row['top1_agreement']:>7.3f} {row['exact_match']:>6.2f} "
              f"{row['ttft_ms']:>12.1f}  {work}" + ("  (FAILED later)" if row["failed"] else ""))
        if row["policy"] == "isolated" and row["ttft_ms_same_sys_all_hit"] is not None:
            print(f"{'isolated same sys':>20} {'':>10} {'':>7} {'':>6} {row['ttft_ms_same_sys_all_hit']:>12.1f}  "
                  "(all hit)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:  # the plot again from a result file, nothing measured
        result = json.loads(args.replot.read_text())
        plot(result["rows"], args.plot, result.get("plot_title", result["device"]))
        return 0
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    load = {"start": os.getloadavg()}
    started = time.time()
    res = run(args, log)
    load["end"] = os.getloadavg()
    result_rows = rows(args, res)
    for row in result_rows:  # recomputing 100 % must be full prefill (DESIGN.md §2)
        if row["policy"] == "cacheblend" and row["param"] == 1.0 and row["kl"] is not None and row["kl"] > FULL_KL_TOL:
            res["failures"].append(f"cacheblend r=1 differs from full prefill: mean KL {row['kl']:.3g} > {FULL_KL_TOL:g}")
    device = device_name()
    command = " ".join([".venv/bin/python", os.path.relpath(__file__, REPO)] + (sys.argv[1:] if argv is None else argv))
    vanilla_row = result_rows[0]
    result = {
        "device": device,
        "rows": result_rows,
        "vanilla_exact_match": vanilla_row["exact_match"],
        "definitions": {
            "kl": "KL(vanilla || setting) in nats of the first generated token's distribution over the whole "
                  "vocabulary (vLLM raw logprobs, logprobs=-1); kl is the mean over prompts (kl_median, kl_max too). "
                  "vanilla's own row compares two identical vanilla requests (the second mostly served by "
                  "vLLM's prefix cache): the harness noise floor",
            "top1_agreement": "the setting is fed vanilla's greedy continuation (continuation tokens, ignore_eos) "
                              "through the ForceTokens logits processor; share of all (prompt, step) pairs where the "
                              "setting's own argmax (raw logprobs, rank 1) equals vanilla's token",
            "exact_match": EM_RULE,
            "same_answer_as_vanilla": "share of prompts whose free answer text equals vanilla's",
            "ttft_ms": "p50 over prompts x repeats of the wall time of generate([one prompt], max_tokens=1, greedy); "
                       "documents cached (a warm-up request per prompt and setting with another sys prompt and "
                       "another document order), the timed request has the documents reordered behind a sys prompt "
                       "never seen before (vLLM's prefix cache serves nothing: num_cached_tokens checked == 0). "
                       "vanilla: a full prefill. isolated: see its ttft_note",
            "ttft_over_full_prefill": "ttft_ms over vanilla's ttft_ms, both p50s of this run (CacheBlend's includes "
                                      "its check pass)",
            "param": "cacheblend: recompute ratio; legolink: tokens recomputed at the start of every chunk; else 0",
        },
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "settings"},
                   "settings": [s.label for s in args.settings], **res["engine"],
                   "startup_s": res["startup_s"], "prompt_tokens": res["prompt_tokens"],
                   "doc_tokens": res["doc_tokens"], "sys_prompt": SYS_TEXT,
                   "per_setting_cache_salt": not args.no_salt},
        "command": command,
        "tasks": [dict(index=t.index, color=t.color, place=t.place, code=t.code, gold_doc=t.gold,
                       distractors=t.distractors, question=t.question, orders=t.orders) for t in res["tasks"]],
        "reference": res["reference"],
        "checks_passed": not res["failures"],
        "failures": res["failures"],
        "final_stats": res["final_stats"],
        "environment": {**versions(), "load_average": load,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                        "wall_s": time.time() - started},
    }
    result["plot_title"] = (f"SmolLM2-135M fp32, {args.prompts} prompts x {args.docs} docs (~{args.doc_tokens} tok), "
                            f"{args.continuation}-token continuation; {device}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result_rows, args.plot, result["plot_title"])

    print_table(result_rows)
    print(f"checks: {'passed' if not res['failures'] else 'FAILED'}")
    for failure in res["failures"][:40]:
        print(f"  {failure}")
    print(f"wall {result['environment']['wall_s']:.0f} s; wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
