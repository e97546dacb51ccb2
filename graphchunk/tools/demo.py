"""Main job until the server lands: segment a RAG prompt, print the chunk-cache plan of two
requests (the second reorders the documents) and the reference oracle's answer.

    graphchunk-demo [--max-new-tokens N]
"""
from __future__ import annotations

import argparse

import transformers

from graphchunk.cache.keys import KeySpace, chunk_key
from graphchunk.cache.pool import ChunkPool
from graphchunk.config import GraphChunkConfig
from graphchunk.reference import models
from graphchunk.reference.oracle import Oracle
from graphchunk.segments import SegmentedPrompt, SeparatorSplitter

SYS = "You answer questions using only the documents."
DOCS = [
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "The Colosseum is in Rome; it could hold about 50,000 spectators.",
    "Big Ben is the nickname of the great bell in London's Elizabeth Tower.",
]
QUESTION = "In which city is the Colosseum?"


SEPARATOR = "##"
"""The seeds' form: an opt-in of a deployment (``graphchunk.separator``) or a request (``graphchunk_separator``)."""


def rag_prompt(docs: list[str]) -> str:
    return f" {SEPARATOR} ".join([SYS, *docs, QUESTION])


def print_plan(name: str, seg: SegmentedPrompt, pool: ChunkPool, space: KeySpace, tokenizer) -> None:
    lay = seg.layout
    print(f"\n{name}: S={lay.sys_len} chunks={list(lay.chunk_lens)} Q={lay.question_len} "
          f"-> question positions start at S+M={lay.question_position}, decode offset {lay.position_offset}")
    hits = 0
    for i in range(lay.num_chunks):
        tokens = seg.sys_tokens + seg.chunk_tokens(i)
        key = chunk_key(space, seg.sys_tokens, seg.chunk_tokens(i))
        entry = pool.lookup(key, tokens)
        verdict = "hit " if entry else "miss"
        hits += entry is not None
        if entry is None:  # a miss is prefilled as sys ‖ chunk into these pool blocks
            entry = pool.insert(key, tokens, len(seg.chunk_tokens(i)))
            pool.mark_ready(entry)
        start, end = seg.bounds[1 + i]
        text = tokenizer.decode(seg.chunk_tokens(i)).strip()
        print(f"  chunk {i + 1}: {verdict} key={key.hex()[:12]} tokens [{start},{end}) "
              f"positions [{lay.sys_len},{lay.sys_len + end - start}) blocks {entry.block_ids}  {text[:50]!r}")
        pool.release(entry)
    m = pool.metrics
    print(f"  pool: {hits}/{lay.num_chunks} chunks hit, {m.pool_blocks_used}/{m.pool_blocks_total} blocks used")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="graphchunk-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    path = models.smollm2_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **models.LOCAL)
    cfg = GraphChunkConfig()
    splitter = SeparatorSplitter(tokenizer, SEPARATOR, max_chunks=cfg.max_chunks, max_chunk_len=cfg.max_chunk_len)
    pool = ChunkPool(num_blocks=64, block_size=16)
    space = KeySpace(model=path.name, dtype="float32")
    oracle = Oracle(path)

    for name, docs in (("request 1", DOCS), ("request 2 (documents reordered)", DOCS[::-1])):
        seg = splitter.split(tokenizer.encode(rag_prompt(docs)))
        print_plan(name, seg, pool, space, tokenizer)
        answer = oracle.generate(list(seg.token_ids), seg.layout, args.max_new_tokens)
        print(f"  oracle answer: {tokenizer.decode(answer.tokens, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
