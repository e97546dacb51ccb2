"""``bench_blend.py``'s settings (no engine): what each setting sends and which cache salt it carries.

Contract:

* ``parse_settings(spec)`` -> ``[Setting]``, vanilla first; ``salt_of(setting)``: the ``cache_salt`` its
  requests carry (which settings share pool entries);
* the tasks are ``rag_tasks``' (``build_tasks``, ``Task``; ``TASK_KINDS`` = its families);
* ``prompt_sizes`` encodes the prompts with the model's tokenizer the way ``GraphChunkLLM`` will
  (``graphchunk.llm.encode_prompt``).
"""
from __future__ import annotations

from dataclasses import dataclass

from graphchunk.engine.request_args import TEMPERATURE_ARG

from perf.answers.rag_tasks import FAMILIES as TASK_KINDS, Task, build_tasks, encode  # noqa: F401  (bench_blend's names)

DEFAULT_SETTINGS = ("vanilla,isolated:1,isolated:0.85,isolated:1.15,none,"
                    "cacheblend:0.05,cacheblend:0.15,cacheblend:0.3,question:0.05,question:0.15,question:0.3,"
                    "legolink:5,legolink:15,legolink:30,cacheblend:1.0")
"""LegoLink's k at the recompute budgets 5/15/30 % of ~100-token documents (the default --doc-tokens)."""
KNOWN = ("vanilla, isolated, isolated:T, none, cacheblend:R, question:R, legolink:K; cacheblend and question take "
         "+S (S sinks per chunk) and /chunk (the ratio per chunk), question @K (its scoring pass through the "
         "first K layers), both xB (picked in blocks of B tokens; without it single tokens, whatever the deployment's "
         "default), e.g. question:0.15+4@2x16/chunk")
SYS_TEXT = "You are a helpful assistant. Answer the question using the documents."
NONCE_SYS = "Session {}. " + SYS_TEXT
"""A sys prompt never seen before (warm-up and timed requests): a fresh 6-hex-digit nonce at its
start, so vLLM's prefix cache cannot serve even its first block."""


# --- settings -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    label: str
    policy: str  # vanilla, isolated, none, cacheblend, question, legolink
    param: float  # isolated: key temperature; cacheblend/question: ratio; legolink: tokens; else 0
    extra: dict | None  # graphchunk extra_args; None: an ordinary prompt

    @property
    def graphchunk(self) -> bool:
        return self.extra is not None

    @property
    def blend(self) -> bool:
        return self.policy in ("none", "cacheblend", "question", "legolink")


VANILLA = Setting("vanilla", "vanilla", 0, None)


def blend_setting(label: str, policy: str, param: float, **policy_args) -> Setting:
    extra = {"graphchunk_mode": "blend", "graphchunk_recompute": policy}
    extra.update({f"graphchunk_recompute_{k}": v for k, v in policy_args.items()})
    return Setting(label, policy, param, extra)


def one_setting(item: str) -> Setting:
    name, colon, value = item.partition(":")
    if name == "vanilla" and not colon:
        return VANILLA
    if name == "isolated" and not colon:  # the deployment's default key temperature (1)
        return Setting("isolated", "isolated", 1.0, {"graphchunk_mode": "isolated"})
    if name == "isolated":
        t = float(value)
        return Setting(f"isolated T={t:g}", "isolated", t, {"graphchunk_mode": "isolated", TEMPERATURE_ARG: t})
    if name == "none" and not colon:
        return blend_setting("blend none", "none", 0)
    if name in ("cacheblend", "question"):
        value, slash, spread = value.partition("/")
        value, x, block = value.partition("x")
        value, at, layers = value.partition("@")
        value, plus, sinks = value.partition("+")
        r, refinements = float(value), {}
        if plus:
            refinements["sinks"] = int(sinks)
        if at:
            refinements["layers"] = int(layers)
        refinements["block"] = int(block) if x else 1  # always sent: the label means what it says
        if slash:
            refinements["spread"] = spread
        label = (f"{name} r={r:g}" + (f" s={sinks}" if plus else "") + (f" L={layers}" if at else "")
                 + (f" B={block}" if x else "") + (f" /{spread}" if slash else ""))
        return blend_setting(label, name, r, ratio=r, **refinements)
    if name == "legolink":
        k = int(value)
        return blend_setting(f"legolink k={k}", "legolink", k, tokens=k)
    raise SystemExit(f"unknown setting {item!r}; known: {KNOWN}")


def parse_settings(spec: str) -> list[Setting]:
    """The settings of ``spec`` (a comma list, or ``all``), vanilla (the reference) first."""
    items = [i.strip() for i in (DEFAULT_SETTINGS if spec == "all" else spec).split(",") if i.strip()]
    out = [VANILLA] + [s for s in map(one_setting, items) if s.policy != "vanilla"]
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"duplicate settings in {spec!r}")
    return out


def salt_of(s: Setting) -> str:
    """The request's cache_salt. Settings sharing one share chunk-pool entries; vLLM's prefix-cache
    blocks stay apart through graphchunk's fingerprint in the salt (blend: policy and parameter;
    isolated: the key temperature where it is not 1). All blend settings share one (a blend chunk
    is computed alone: the same KV for every policy), all isolated settings that send a key
    temperature another (the pool keeps plain keys; the temperature applies as they are copied
    into a request); vanilla and plain ``isolated`` (whose fingerprint equals ``isolated:1``'s)
    have their own."""
    if s.blend:
        return "bench-blend:blend"
    if s.policy == "isolated" and TEMPERATURE_ARG in s.extra:
        return "bench-blend:isolated:T"  # never a label
    return f"bench-blend:{s.label}"


# --- prompt sizes ---------------------------------------------------------------------------------

def prompt_sizes(tokenizer, tasks: list[Task]) -> tuple[list[int], list[list[int]], int]:
    """Before the engine exists: every prompt's tokens, its documents' tokens, and the longest
    prompt a timed request can send (its sys a nonce sys instead of SYS_TEXT)."""
    from graphchunk.llm import RagPrompt, encode_prompt

    encoded = [encode(tokenizer, SYS_TEXT, t) for t in tasks]
    prompt_lens = [len(ids) for ids, _ in encoded]
    doc_lens = [[b - a for a, b in zip(bounds[:-1], bounds[1:])] for _, bounds in encoded]
    longest_sys = encode_prompt(tokenizer, RagPrompt(NONCE_SYS.format("ffffff"), ["x"], "q", chat=True))[1][0]
    max_prompt = max(prompt_lens) - encoded[0][1][0] + longest_sys + 8
    return prompt_lens, doc_lens, max_prompt
