"""``bench_blend.py``'s settings and retrieval task (no engine): what each setting sends, the
documents with their planted facts, the questions and the document orders of every round.

Documents are CPython help-topic text (``graphchunk.reference.text.help_paragraphs``), whole
sentences, 0.75x..1.25x --doc-tokens tokens each; ``prompt_sizes`` encodes the prompts with the
model's tokenizer the way ``GraphChunkLLM`` will (``graphchunk.llm.encode_prompt``).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

DEFAULT_SETTINGS = ("vanilla,isolated,none,cacheblend:0.05,cacheblend:0.15,cacheblend:0.3,"
                    "legolink:1,legolink:4,legolink:16,cacheblend:1.0")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown")
PLACES = ("kitchen", "library", "garage", "basement", "office", "studio", "warehouse", "workshop",
          "greenhouse", "attic")
SYS_TEXT = "You are a helpful assistant. Answer the question using the documents."
NONCE_SYS = "Session {}. " + SYS_TEXT
"""A sys prompt never seen before (warm-up and timed requests): a fresh 6-hex-digit nonce at its
start, so vLLM's prefix cache cannot serve even its first block."""


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
    from graphchunk.reference.text import help_paragraphs

    paragraphs = help_paragraphs()
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



def prompt_sizes(tokenizer, tasks: list[Task]) -> tuple[list[int], list[list[int]], int]:
    """Before the engine exists: every prompt's tokens, its documents' tokens, and the longest
    prompt a timed request can send (its sys a nonce sys instead of SYS_TEXT)."""
    from graphchunk.llm import RagPrompt, encode_prompt

    encoded = [encode_prompt(tokenizer, RagPrompt(SYS_TEXT, t.docs, t.question, chat=True)) for t in tasks]
    prompt_lens = [len(ids) for ids, _ in encoded]
    doc_lens = [[b - a for a, b in zip(bounds[:-1], bounds[1:])] for _, bounds in encoded]
    longest_sys = encode_prompt(tokenizer, RagPrompt(NONCE_SYS.format("ffffff"), ["x"], "q", chat=True))[1][0]
    max_prompt = max(prompt_lens) - encoded[0][1][0] + longest_sys + 8
    return prompt_lens, doc_lens, max_prompt
