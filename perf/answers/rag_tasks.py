"""Retrieval tasks for the quality benchmarks (``bench_blend.py`` through vLLM, ``bench_oracle_quality.py``
on the HF oracle): documents of real text with planted facts, a question, and how an answer is scored.

Contract:

* ``build_tasks(tokenizer, args, rng)`` -> ``[Task]``: prompt i is of family ``args.families[i % n]``,
  with ``args.docs`` documents (``parse_docs``: ``6`` or a range ``5-8``, drawn per prompt) of
  ~``args.doc_tokens`` tokens (0.75x..1.25x), at most ``args.distractors`` distractor facts;
* ``Task.correct(text)``: exact match of a free answer; ``Task.answer_step(tokenizer, tokens)``: the
  first continuation step that starts an answer (where KL "at the first answer token" is read);
* ``encode(tokenizer, sys_text, task)``: a task's token ids and boundaries the way ``GraphChunkLLM``
  sends them (``graphchunk.llm.encode_prompt``, documents of a chat request: the documents path of
  the OpenAI server).

Families (``FAMILIES``), none of them an answer copied next to the question's own words only:

* ``fact``: "The access code for the {color} {place} is {NNNN}." in one document, the same fact for
  other colors/places in others; "What is the access code for the {color} {place}?" (the question
  repeats the fact's words: the easy family, kept from the first benchmark);
* ``paraphrase``: the code stated in other words ("The keypad at the {color} {place} opens with
  {NNNN}.", four phrasings, none with "access code"), distractors phrased the same ways; the same
  question;
* ``two_hop``: "The {color} {place} is in building {Name}." in one document, "The access code for
  building {Name} is {NNNN}." in another, decoy chains in others; "What is the access code for the
  building where the {color} {place} is?";
* ``which_doc``: every document titled (its text starts "Title: {Tree}\\n"), one says "The {color}
  {place} was repainted last spring.", others the same of other colors/places; "Which document
  mentions the {color} {place}? Answer with its title." (correct: the first title the answer names
  is the gold one).

Documents are CPython help-topic text (``graphchunk.reference.text.help_paragraphs``), whole
sentences. The corpus holds ~33k distinct tokens, so base texts recur across prompts (never within
one); every planted fact makes its document a text of its own.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

FAMILIES = ("fact", "paraphrase", "two_hop", "which_doc")
CODE_FAMILIES = ("fact", "paraphrase", "two_hop")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown")
PLACES = ("kitchen", "library", "garage", "basement", "office", "studio", "warehouse", "workshop",
          "greenhouse", "attic")
BUILDINGS = ("Ashford", "Bramley", "Calder", "Dunmore", "Elstree", "Fenwick", "Garrow", "Hollis", "Ingram",
             "Jarvis", "Kendal", "Lowther", "Marlow", "Norcott", "Oakley", "Penrose", "Quinton", "Redfern",
             "Selwyn", "Thornby")
TITLES = ("Alder", "Birch", "Cedar", "Hazel", "Juniper", "Larch", "Maple", "Rowan", "Spruce", "Willow", "Aspen",
          "Hawthorn")
PARAPHRASES = ("The keypad at the {color} {place} opens with {code}.",
               "Anyone who needs to get into the {color} {place} types {code} by its door.",
               "To unlock the {color} {place}, staff enter {code}.",
               "The door of the {color} {place} takes the combination {code}.")
QUESTIONS = {"fact": "What is the access code for the {color} {place}?",
             "paraphrase": "What is the access code for the {color} {place}?",
             "two_hop": "What is the access code for the building where the {color} {place} is?",
             "which_doc": "Which document mentions the {color} {place}? Answer with its title."}
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def parse_docs(spec) -> tuple[int, int]:
    """``6`` -> (6, 6); ``5-8`` -> (5, 8)."""
    lo, _, hi = str(spec).partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise SystemExit(f"--docs {spec!r}: give N or A-B with 1 <= A <= B")
    return lo, hi


def parse_families(spec: str) -> tuple[str, ...]:
    out = FAMILIES if spec == "all" else tuple(f.strip() for f in spec.split(",") if f.strip())
    unknown = [f for f in out if f not in FAMILIES]
    if unknown or not out:
        raise SystemExit(f"--families {spec!r}: known {', '.join(FAMILIES)} (or all)")
    return out


@dataclass
class Task:
    index: int
    kind: str  # a family
    docs: list[str]  # canonical order
    color: str
    place: str
    answer: str  # the expected code, or the gold document's title
    gold: list[int]  # the documents holding the answer's facts (two for two_hop)
    facts: list[str]  # the gold facts, as planted, in gold's order
    distractors: list[dict]  # {"doc", "fact", ...}: one planted distractor fact per document
    question: str
    building: str | None = None  # two_hop: the building the color/place is in
    titles: list[str] | None = None  # which_doc: every document's title, canonical order
    orders: list[list[int]] = field(default_factory=list)  # [warm-up, timed round 1..R]

    def correct(self, text: str) -> bool:
        """Exact match: the code as a whole number; which_doc: the first title named is the gold one."""
        if self.kind != "which_doc":
            return re.search(rf"(?<!\d){self.answer}(?!\d)", text) is not None
        named = [(m.start(), t) for t in self.titles for m in [re.search(rf"\b{t}\b", text)] if m]
        return bool(named) and min(named)[1] == self.answer

    def answer_step(self, tokenizer, tokens: list[int]) -> tuple[int, bool]:
        """(the first step whose token starts an answer, whether none did and 0 stands in): a token
        showing a digit (code families) or a token after which the text names a title (which_doc)."""
        for j, tok in enumerate(tokens):
            if self.kind != "which_doc":
                if any(ch.isdigit() for ch in tokenizer.decode([tok])):
                    return j, False
            elif any(re.search(rf"\b{t[:3]}", tokenizer.decode(tokens[:j + 1])) for t in self.titles):
                return j, False
        return 0, True

    def record(self) -> dict:
        return dict(index=self.index, kind=self.kind, color=self.color, place=self.place, building=self.building,
                    answer=self.answer, gold_docs=self.gold, facts=self.facts, distractors=self.distractors,
                    titles=self.titles, question=self.question, orders=self.orders, n_docs=len(self.docs))


class Corpus:
    """Documents of whole sentences, lo..hi tokens each, and unique 4-digit codes.

    The help topics' distinct paragraphs (a paragraph whose first 80 characters an earlier one
    had is left out) as one stream of sentences in topic order, cut into consecutive documents of
    lo..hi tokens (each its own random length). ``draw(k)`` hands out k distinct ones in a random
    order, every base text once before any comes again."""

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
        self.all = self.pack(sentences, sizes)
        self.queue: list[list[str]] = []

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

    def draw(self, k: int) -> list[list[str]]:
        if k > len(self.all):
            raise SystemExit(f"the corpus has {len(self.all)} documents of this length; ask for fewer per prompt")
        if len(self.queue) < k:
            fresh = list(self.all)
            self.rng.shuffle(fresh)
            self.queue = fresh + self.queue  # the rest of the old round first (popped from the end)
        return [self.queue.pop() for _ in range(k)]

    def code(self) -> str:
        while True:
            c = str(self.rng.randint(1000, 9999))
            if c not in self.codes:
                self.codes.add(c)
                return c


def other(rng: random.Random, pool, *avoid):
    return rng.choice([x for x in pool if x not in avoid])


def other_subjects(rng, color, place, n) -> list[tuple[str, str]]:
    """n (color, place) pairs, each differing from the question's in color, place or both."""
    kinds = [lambda: (other(rng, COLORS, color), place), lambda: (color, other(rng, PLACES, place)),
             lambda: (other(rng, COLORS, color), other(rng, PLACES, place))]
    out = []
    while len(out) < n:
        pair = kinds[len(out) % 3]()
        if pair not in out:
            out.append(pair)
    return out


def fact_facts(rng, corpus, color, place, n):
    """fact: one gold fact, distractors = the same fact for another color and/or place."""
    code = corpus.code()
    gold = [f"The access code for the {color} {place} is {code}."]
    distractors = []
    for c2, p2 in other_subjects(rng, color, place, n):
        code2 = corpus.code()
        distractors.append(dict(fact=f"The access code for the {c2} {p2} is {code2}.", color=c2, place=p2,
                                code=code2))
    return code, None, gold, distractors


def paraphrase_facts(rng, corpus, color, place, n):
    """paraphrase: the code in one of PARAPHRASES' words, distractors in the others."""
    code = corpus.code()
    phrasings = rng.sample(range(len(PARAPHRASES)), len(PARAPHRASES))
    gold = [PARAPHRASES[phrasings[0]].format(color=color, place=place, code=code)]
    distractors = []
    for j, (c2, p2) in enumerate(other_subjects(rng, color, place, n)):
        code2 = corpus.code()
        text = PARAPHRASES[phrasings[(j + 1) % len(PARAPHRASES)]].format(color=c2, place=p2, code=code2)
        distractors.append(dict(fact=text, color=c2, place=p2, code=code2))
    return code, None, gold, distractors


def two_hop_facts(rng, corpus, color, place, n):
    """two_hop: where the color/place is (one document) and that building's code (another);
    distractors alternate: another color/place in another building, then that building's code (a
    whole decoy chain), and so on."""
    code = corpus.code()
    buildings = rng.sample(BUILDINGS, n + 1)
    building = buildings[0]
    gold = [f"The {color} {place} is in building {building}.", f"The access code for building {building} is {code}."]
    distractors = []
    subjects = other_subjects(rng, color, place, (n + 1) // 2)
    for j in range(n):
        decoy = buildings[1 + j - j % 2]  # odd j: the code of the building the even j before placed
        if j % 2 == 0:
            c2, p2 = subjects[j // 2]
            distractors.append(dict(fact=f"The {c2} {p2} is in building {decoy}.", color=c2, place=p2,
                                    building=decoy))
        else:
            code2 = corpus.code()
            distractors.append(dict(fact=f"The access code for building {decoy} is {code2}.", building=decoy,
                                    code=code2))
    return code, building, gold, distractors


def which_doc_facts(rng, corpus, color, place, n):
    """which_doc: the gold document says the color/place was repainted; distractors say it of others.
    The answer (the gold title) is filled in by ``build_task``."""
    gold = [f"The {color} {place} was repainted last spring."]
    distractors = [dict(fact=f"The {c2} {p2} was repainted last spring.", color=c2, place=p2)
                   for c2, p2 in other_subjects(rng, color, place, n)]
    return None, None, gold, distractors


FACTS = {"fact": fact_facts, "paraphrase": paraphrase_facts, "two_hop": two_hop_facts, "which_doc": which_doc_facts}


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
    kind = args.families[i % len(args.families)]
    lo, hi = parse_docs(args.docs)
    k = rng.randint(lo, hi)
    color, place = rng.choice(COLORS), rng.choice(PLACES)
    n_gold = 2 if kind == "two_hop" else 1
    if k < n_gold:
        raise SystemExit(f"a {kind} task needs at least {n_gold} documents; raise --docs")
    code, building, gold_facts, distractors = FACTS[kind](rng, corpus, color, place, min(args.distractors, k - n_gold))
    slots = list(range(k))
    rng.shuffle(slots)
    gold = slots[:n_gold]
    raw = corpus.draw(k)
    docs = [" ".join(s) for s in raw]
    for slot, fact in zip(slots, gold_facts + [d["fact"] for d in distractors]):
        at = rng.randint(0, len(raw[slot]))
        docs[slot] = " ".join(raw[slot][:at] + [fact] + raw[slot][at:])
    for slot, d in zip(slots[n_gold:], distractors):
        d["doc"] = slot
    titles = None
    if kind == "which_doc":
        titles = rng.sample(TITLES, k)
        docs = [f"Title: {t}\n{d}" for t, d in zip(titles, docs)]
        code = titles[gold[0]]
    return Task(i, kind, docs, color, place, code, gold, gold_facts, distractors,
                QUESTIONS[kind].format(color=color, place=place), building, titles,
                timed_orders(rng, k, getattr(args, "repeats", 0) + 1))


def build_tasks(tokenizer, args, rng: random.Random) -> list[Task]:
    if parse_docs(args.docs)[1] > len(TITLES) and "which_doc" in args.families:
        raise SystemExit(f"which_doc titles at most {len(TITLES)} documents per prompt")
    corpus = Corpus(tokenizer, args.doc_tokens, rng)
    return [build_task(i, corpus, args, rng) for i in range(args.prompts)]


def encode(tokenizer, sys_text: str, task: Task, order: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Token ids and boundaries of a task's prompt as a chat request's documents (``GraphChunkLLM.chat``'s
    and the OpenAI server's placement)."""
    from graphchunk.llm import RagPrompt, encode_prompt

    docs = task.docs if order is None else [task.docs[d] for d in order]
    return encode_prompt(tokenizer, RagPrompt(sys_text, docs, task.question, chat=True))
