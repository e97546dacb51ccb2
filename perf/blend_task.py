"""``bench_blend.py``'s settings and retrieval tasks (no engine): what each setting sends, the
documents with their planted facts, the questions and the document orders of every round.

Contract:

* ``parse_settings(spec)`` -> ``[Setting]``, vanilla first; ``salt_of(setting)``: the ``cache_salt`` its requests carry (which settings share pool entries);
* ``build_tasks(tokenizer, args, rng)`` -> ``[Task]``: prompt i is a ``fact`` task for even i and
  a ``two_hop`` task for odd i (``TASK_KINDS``); every task records its kind, the documents holding
  the answer (``gold``), its distractor facts and the orders of its warm-up and timed rounds;
* ``prompt_sizes`` encodes the prompts with the model's tokenizer the way ``GraphChunkLLM`` will
  (``graphchunk.llm.encode_prompt``).

Documents are CPython help-topic text (``graphchunk.reference.text.help_paragraphs``), whole
sentences, 0.75x..1.25x --doc-tokens tokens each, every document of the run distinct.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from graphchunk.engine.frontend import TEMPERATURE_ARG

DEFAULT_SETTINGS = ("vanilla,isolated:1,isolated:0.85,isolated:1.15,none,"
                    "cacheblend:0.05,cacheblend:0.15,cacheblend:0.3,question:0.05,question:0.15,question:0.3,"
                    "legolink:5,legolink:15,legolink:30,cacheblend:1.0")
"""LegoLink's k at the recompute budgets 5/15/30 % of ~100-token documents (the default --doc-tokens)."""
KNOWN = "vanilla, isolated, isolated:T, none, cacheblend:R, question:R, legolink:K"
TASK_KINDS = ("fact", "two_hop")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown")
PLACES = ("kitchen", "library", "garage", "basement", "office", "studio", "warehouse", "workshop",
          "greenhouse", "attic")
BUILDINGS = ("Ashford", "Bramley", "Calder", "Dunmore", "Elstree", "Fenwick", "Garrow", "Hollis", "Ingram",
             "Jarvis", "Kendal", "Lowther", "Marlow", "Norcott", "Oakley", "Penrose", "Quinton", "Redfern",
             "Selwyn", "Thornby")
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
        r = float(value)
        return blend_setting(f"{name} r={r:g}", name, r, ratio=r)
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


# --- tasks ----------------------------------------------------------------------------------------

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class Task:
    index: int
    kind: str  # fact or two_hop
    docs: list[str]  # canonical order
    color: str
    place: str
    code: str  # the expected answer
    gold: list[int]  # the documents holding the answer's facts (two for two_hop)
    facts: list[str]  # the gold facts, as planted, in gold's order
    distractors: list[dict]  # {"doc", "fact", ...}: one planted distractor fact per document
    question: str
    building: str | None = None  # two_hop: the building the color/place is in
    orders: list[list[int]] = field(default_factory=list)  # [warm-up, timed round 1..R]

    def record(self) -> dict:
        return dict(index=self.index, kind=self.kind, color=self.color, place=self.place, building=self.building,
                    code=self.code, gold_docs=self.gold, facts=self.facts, distractors=self.distractors,
                    question=self.question, orders=self.orders)


class Corpus:
    """Distinct documents of whole sentences, lo..hi tokens each, and unique 4-digit codes.

    The help topics' distinct paragraphs (a paragraph whose first 80 characters an earlier one
    had is left out) as one stream of sentences in topic order, cut into consecutive documents of
    lo..hi tokens (each its own random length), handed out in a random order: the whole corpus
    (~33k tokens) is used: a run can have about 30k / doc_tokens documents (256 at 120)."""

    def __init__(self, tokenizer, doc_tokens: int, rng: random.Random):
        from graphchunk.reference.text import help_paragraphs

        self.lo, self.hi = int(0.75 * doc_tokens), int(1.25 * doc_tokens)
        self.rng, self.codes = rng, set()
        heads, sentences = set(), []
        for paragraph in help_paragraphs():
            if paragraph[:80] not in heads:
                heads.add(paragraph[:80])
                sentences += SENTENCE_END.split(paragraph)
        sizes = [len(ids) for ids in tokenizer(sentences, add_special_tokens=False)["input_ids"]]
        self.docs = self.pack(sentences, sizes)
        rng.shuffle(self.docs)

    def pack(self, sentences: list[str], sizes: list[int]) -> list[list[str]]:
        docs, kept, used, target = [], [], 0, self.rng.randint(self.lo, self.hi)
        for sentence, n in zip(sentences, sizes):
            if n > self.hi:  # a sentence longer than a document (a code listing): skipped
                continue
            if used + n > target and used >= self.lo:
                docs.append(kept)
                kept, used, target = [], 0, self.rng.randint(self.lo, self.hi)
            if used + n <= self.hi:
                kept.append(sentence)
                used += n
        return docs + ([kept] if used >= self.lo else [])

    def document(self) -> list[str]:
        if not self.docs:
            raise SystemExit("the corpus has too few distinct documents for this workload; lower --prompts, --docs "
                             "or --doc-tokens")
        return self.docs.pop()

    def code(self) -> str:
        while True:
            c = str(self.rng.randint(1000, 9999))
            if c not in self.codes:
                self.codes.add(c)
                return c


def other(rng: random.Random, pool, *avoid):
    return rng.choice([x for x in pool if x not in avoid])


def fact_facts(rng, corpus, color, place, n_distractors):
    """fact: one gold fact, distractors = the same fact for another color and/or place."""
    code = corpus.code()
    gold = [f"The access code for the {color} {place} is {code}."]
    distractors = []
    for j in range(n_distractors):
        c2, p2 = [(other(rng, COLORS, color), place), (color, other(rng, PLACES, place)),
                  (other(rng, COLORS, color), other(rng, PLACES, place))][j % 3]
        code2 = corpus.code()
        distractors.append(dict(fact=f"The access code for the {c2} {p2} is {code2}.", color=c2, place=p2,
                                code=code2))
    return code, None, gold, distractors


def two_hop_facts(rng, corpus, color, place, n_distractors):
    """two_hop: where the color/place is (one document) and that building's code (another);
    distractors alternate: another color/place in another building, then that building's code (a
    whole decoy chain), and so on."""
    code = corpus.code()
    buildings = rng.sample(BUILDINGS, n_distractors + 1)
    building = buildings[0]
    gold = [f"The {color} {place} is in building {building}.", f"The access code for building {building} is {code}."]
    distractors = []
    for j in range(n_distractors):
        decoy = buildings[1 + j - j % 2]  # odd j: the code of the building the even j before placed
        if j % 2 == 0:
            c2, p2 = [(other(rng, COLORS, color), place), (color, other(rng, PLACES, place))][j // 2 % 2]
            distractors.append(dict(fact=f"The {c2} {p2} is in building {decoy}.", color=c2, place=p2,
                                    building=decoy))
        else:
            code2 = corpus.code()
            distractors.append(dict(fact=f"The access code for building {decoy} is {code2}.", building=decoy,
                                    code=code2))
    return code, building, gold, distractors


QUESTIONS = {"fact": "What is the access code for the {color} {place}?",
             "two_hop": "What is the access code for the building where the {color} {place} is?"}
FACTS = {"fact": fact_facts, "two_hop": two_hop_facts}


def timed_orders(rng: random.Random, k: int, rounds: int) -> list[list[int]]:
    """Warm-up and timed orders: each with a first document that was first in no earlier order
    (canonical included), as long as there are enough documents."""
    firsts, orders = [0], []
    for _ in range(rounds):
        fresh = [d for d in range(k) if d not in firsts] or list(range(1, k)) or [0]
        first = rng.choice(fresh)
        firsts.append(first)
        rest = [d for d in range(k) if d != first]
        rng.shuffle(rest)
        orders.append([first] + rest)
    return orders


def build_task(i: int, corpus: Corpus, args, rng: random.Random) -> Task:
    kind = TASK_KINDS[i % len(TASK_KINDS)]
    k = args.docs
    color, place = rng.choice(COLORS), rng.choice(PLACES)
    n_gold = 1 if kind == "fact" else 2
    if k < n_gold:
        raise SystemExit(f"a {kind} task needs at least {n_gold} documents; raise --docs")
    code, building, gold_facts, distractors = FACTS[kind](rng, corpus, color, place,
                                                           min(args.distractors, k - n_gold))
    slots = list(range(k))
    rng.shuffle(slots)
    gold = slots[:n_gold]
    raw = [corpus.document() for _ in range(k)]
    docs = [" ".join(s) for s in raw]
    for slot, fact in zip(slots, gold_facts + [d["fact"] for d in distractors]):
        at = rng.randint(0, len(raw[slot]))
        docs[slot] = " ".join(raw[slot][:at] + [fact] + raw[slot][at:])
    for slot, d in zip(slots[n_gold:], distractors):
        d["doc"] = slot
    return Task(i, kind, docs, color, place, code, gold, gold_facts, distractors,
                QUESTIONS[kind].format(color=color, place=place), building, timed_orders(rng, k, args.repeats + 1))


def build_tasks(tokenizer, args, rng: random.Random) -> list[Task]:
    corpus = Corpus(tokenizer, args.doc_tokens, rng)
    return [build_task(i, corpus, args, rng) for i in range(args.prompts)]


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
