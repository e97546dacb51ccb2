"""The pressure soak's trace (``pressure.py``): request bodies, each one prompt or a batch of 2-4
in one ``/v1/completions`` body, some under a tenant ``cache_salt``, over (sys prompt, document set)
combinations drawn from the soak's corpus; their JSON bodies and the client that reads every choice.

Contract: ``build_combos`` and ``build_trace`` are functions of the corpus, the arguments and the
seeded ``rng`` only (both modes replay the same trace); ``BodyEncoder.body`` is the request body a
client sends; ``BodyClient`` is the soak's ``Client`` with every choice of a body read and the
``abort_misses`` action (a prompt of documents nobody else carries, closed while it waits).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

from perf.common.client import Client, Outcome
from perf.common.trace import ACTIONS, Encoder, Item, draw_action

PRESSURE_ACTIONS = (*ACTIONS, "abort_misses")
"""The soak's client actions, and ``abort_misses``: a prompt of documents no other request carries
(all misses), streamed and closed while it waits for them (``BodyClient.abort_misses``)."""
SALTS = ("tenant-a", "tenant-b")

@dataclass(frozen=True)
class Body(Item):
    """One request body: ``prompts`` (one, or a batch), each a soak ``Item`` (its fields sys, docs,
    question, as_ids); the body's own sys / docs / question are its first prompt's."""
    prompts: tuple[Item, ...] = ()
    salt: str | None = None
    batch: str = ""
    """'' (a single prompt), 'ids' (token ids sharing one layout) or 'text' (separator text)."""
    combos: tuple[int, ...] = ()


@dataclass(frozen=True)
class Combo:
    sys: str
    doc_ids: tuple[int, ...]
    questions: tuple[str, ...]


def fresh_docs(args) -> int:
    """Documents kept apart for ``abort_misses`` prompts, each carried once (the corpus's last):
    enough for the bodies the rate draws on average, and 4 more (a body draws ``abort_prefill``
    instead once they run out: the corpus holds a few hundred documents)."""
    return (int(args.requests * args.abort_misses) + 4) * args.docs_per_request[1] if args.abort_misses else 0


def build_combos(corpus, args, rng: random.Random) -> list[Combo]:
    combos = []
    shared = len(corpus.docs) - fresh_docs(args)
    for _ in range(args.combos):
        k = rng.randint(*args.docs_per_request)
        docs = tuple(rng.sample(range(shared), k))
        combos.append(Combo(rng.choice(corpus.systems), docs,
                            tuple(rng.sample(corpus.questions, args.questions_per_combo))))
    return combos


def build_trace(corpus, combos: list[Combo], args, rng: random.Random) -> list[Body]:
    def prompt(c: int, order: list[int] | None = None, question: str | None = None, as_ids: bool = True) -> Item:
        combo = combos[c]
        order = order if order is not None else rng.sample(combo.doc_ids, len(combo.doc_ids))
        return Item(0, combo.sys, tuple(corpus.docs[d] for d in order), question or rng.choice(combo.questions),
                    as_ids, doc_ids=tuple(order))

    rates = {"abort_stream": args.abort_stream, "abort_prefill": args.abort_prefill,
             "abort_nostream": args.abort_nostream, "abort_misses": args.abort_misses}
    fresh = list(range(len(corpus.docs) - fresh_docs(args), len(corpus.docs)))
    bodies = []
    for index in range(args.requests):
        action = draw_action(rng, rates)
        if action == "abort_misses" and len(fresh) >= args.docs_per_request[1]:
            order = tuple(fresh.pop() for _ in range(rng.randint(*args.docs_per_request)))
            p = Item(0, rng.choice(corpus.systems), tuple(corpus.docs[d] for d in order), rng.choice(corpus.questions),
                     True, doc_ids=order)
            bodies.append(Body(index, p.sys, p.docs, p.question, True, action, rng.random(), order, prompts=(p,),
                               combos=(-1,)))
            continue
        action = "abort_prefill" if action == "abort_misses" else action
        c = rng.randrange(len(combos))
        if rng.random() < args.batch_fraction:
            size = rng.randint(2, 4)
            if rng.random() < 0.5:  # one document order, several questions: one set of boundaries
                first = prompt(c)
                prompts = [first] + [replace(first, question=rng.choice(combos[c].questions)) for _ in range(size - 1)]
                kind, used = "ids", (c,) * size
            else:
                used = (c, *(rng.randrange(len(combos)) for _ in range(size - 1)))
                prompts, kind = [prompt(u, as_ids=False) for u in used], "text"
        else:
            prompts, kind, used = [prompt(c, as_ids=rng.random() < args.ids_fraction)], "", (c,)
        salt = rng.choice(SALTS) if rng.random() < args.salt_fraction else None
        first = prompts[0]
        bodies.append(Body(index, first.sys, first.docs, first.question, first.as_ids, action, rng.random(),
                           first.doc_ids, prompts=tuple(prompts), salt=salt, batch=kind, combos=used))
    return bodies


class BodyEncoder(Encoder):
    """The soak's encoder for bodies of one or several prompts, with a tenant salt."""

    def body(self, item: Body, stream: bool) -> dict:
        body = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens, "ignore_eos": True,
                "return_token_ids": True, "stream": stream}
        if item.prompts[0].as_ids:
            encoded = [self.ids(p) for p in item.prompts]
            if any(b != encoded[0][1] for _, b in encoded):
                raise ValueError("a batch of token-id prompts must share its boundaries (one vllm_xargs per body)")
            prompts = [ids for ids, _ in encoded]
            body["vllm_xargs"] = {"graphchunk_boundaries": encoded[0][1]}
        else:
            prompts = [self.text(p) for p in item.prompts]
        body["prompt"] = prompts if len(prompts) > 1 else prompts[0]
        if item.salt is not None:
            body["cache_salt"] = item.salt
        return body


class BodyClient(Client):
    """The soak's client, reading every choice of a completed body (``Outcome.choices``: its
    prompts' (prompt token ids, generated token ids), in prompt order)."""

    def complete(self, item: Body, out: Outcome) -> None:
        body = self.post(item, out)
        if body is None:
            return
        choices = sorted(body["choices"], key=lambda c: c["index"])
        out.choices = [(c.get("prompt_token_ids"), c.get("token_ids")) for c in choices]
        if len(out.choices) != len(item.prompts):
            out.error = f"{len(out.choices)} choices for {len(item.prompts)} prompts"
            return
        out.prompt_ids, out.token_ids = out.choices[0]
        out.completion_tokens = body.get("usage", {}).get("completion_tokens", 0)
        out.status = "ok"
        self.estimates.add("latency", time.monotonic() - out.start)
        self.close()

    miss_window = 2.0
    """abort_misses: seconds after the response headers within which the client closes (its
    ``delay`` share of them), while the request's misses are computed (``--abort-misses-window``)."""

    def abort_misses(self, item: Body, out: Outcome) -> None:
        self._streamed(item, out, item.delay * self.miss_window)
        if out.status == "aborted" and out.kind == "abort_prefill":
            out.kind = "abort_misses"
