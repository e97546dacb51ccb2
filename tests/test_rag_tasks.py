"""The quality benchmarks' tasks (perf/answers/rag_tasks.py): what each family plants where, and how an
answer is scored. Host-side, the SmolLM2 tokenizer, no model."""
from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest

from perf.answers.rag_tasks import FAMILIES, PARAPHRASES, build_tasks, encode, parse_docs, parse_families


@pytest.fixture(scope="module")
def tasks(tokenizer):
    args = SimpleNamespace(prompts=8, families=FAMILIES, docs="5-8", doc_tokens=150, distractors=3, repeats=1)
    return build_tasks(tokenizer, args, random.Random(0))


def test_families_in_turn_with_their_facts_in_their_documents(tasks):
    assert [t.kind for t in tasks] == list(FAMILIES) * 2
    for t in tasks:
        assert 5 <= len(t.docs) <= 8 and len(set(t.docs)) == len(t.docs)
        for doc, fact in zip(t.gold, t.facts):
            assert fact in t.docs[doc]
        for d in t.distractors:
            assert d["fact"] in t.docs[d["doc"]] and d["doc"] not in t.gold
        others = [i for i in range(len(t.docs)) if i not in t.gold]
        assert all(f not in t.docs[i] for f in t.facts for i in others)


def test_paraphrase_states_the_code_in_other_words_than_the_question(tasks):
    for t in (t for t in tasks if t.kind == "paraphrase"):
        assert "access code" in t.question and "access code" not in t.facts[0]
        assert t.answer in t.facts[0]
        assert any(re.fullmatch(p.format(color=t.color, place=t.place, code=t.answer).replace(".", r"\."), t.facts[0])
                   for p in PARAPHRASES)


def test_which_doc_titles_every_document_and_scores_the_first_title_named(tasks):
    t = next(t for t in tasks if t.kind == "which_doc")
    assert all(doc.startswith(f"Title: {title}\n") for doc, title in zip(t.docs, t.titles))
    assert t.answer == t.titles[t.gold[0]]
    wrong = next(x for x in t.titles if x != t.answer)
    assert t.correct(f"The document is {t.answer}.")
    assert not t.correct(f"It is {wrong}, not {t.answer}.")
    assert t.correct(f"It is {t.answer}, not {wrong}.")
    assert not t.correct("I do not know.")


def test_codes_count_as_whole_numbers_only(tasks):
    t = next(t for t in tasks if t.kind == "fact")
    assert t.correct(f"The code is {t.answer}.")
    assert not t.correct(f"The code is {t.answer}1.") and not t.correct(f"The code is 1{t.answer}.")


def test_answer_step_finds_where_the_answer_starts(tasks, tokenizer):
    fact = next(t for t in tasks if t.kind == "fact")
    tokens = tokenizer.encode(f"The code is {fact.answer}.")
    step, fallback = fact.answer_step(tokenizer, tokens)
    assert not fallback and any(ch.isdigit() for ch in tokenizer.decode([tokens[step]]))
    assert not any(ch.isdigit() for ch in tokenizer.decode(tokens[:step]))
    assert fact.answer_step(tokenizer, tokenizer.encode("No idea."))[1]


def test_prompts_are_chat_documents_with_one_chunk_per_document(tasks, tokenizer):
    t = tasks[0]
    ids, bounds = encode(tokenizer, "You are a helpful assistant.", t)
    assert len(bounds) == len(t.docs) + 1
    text = tokenizer.decode(ids)
    assert all(doc.split(" ")[0] in text for doc in t.docs) and t.question in text


def test_bad_specs_are_refused():
    assert parse_docs("6") == (6, 6) and parse_docs("5-8") == (5, 8)
    with pytest.raises(SystemExit, match="--docs"):
        parse_docs("8-5")
    with pytest.raises(SystemExit, match="known"):
        parse_families("fact,trivia")
