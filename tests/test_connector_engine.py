"""graphchunk's KV connector in a running engine beside another connector (issue 28 items 3-4).

One GraphChunkLLM (SmolLM2-135M, fp32, eager: the point is the composition, not the graphs) whose
``--kv-transfer-config`` is vLLM's MultiConnector of graphchunk's connector first and vLLM's
ExampleConnector (its reference disk connector: the only one of vLLM 0.32's connectors that runs
on the CPU platform; it keys its files by token ids alone, so the traffic here never lets it
see a segmented request's tokens as an ordinary prompt's, docs/limits.md), and whose
``--kv-events-config`` publishes vLLM's KV events over ZMQ to a subscriber of the test's.

- a segmented request is served by graphchunk (its chunks looked up in the pool) and matches the
  isolated-mode oracle;
- an ordinary prompt is stored by ExampleConnector and, after vLLM's prefix cache is reset,
  served by it (``num_cached_tokens``: its whole blocks) with the same output;
- the pool's entries arrive on the KV-event stream as BlockStored (medium 'graphchunk', the
  entry's tokens) and, once the pool is reset, as BlockRemoved.
"""
from __future__ import annotations

import time

import pytest

import engines
from exactness import LIMITS, assert_matches_oracle, joined_sources, sampling
from graphchunk.llm import RagPrompt
from graphchunk.reference import models
from graphchunk.segments import split_at
from graphchunk.tools.serve_demo import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("oracle_references")]

EVENTS_DEADLINE_S = 60.0


def subscribe(port: int):
    """A ZMQ subscriber of vLLM's KV-event stream on ``port`` (and its context)."""
    import zmq

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub, context


@pytest.fixture(scope="module")
def subscriber(multi_llm):
    """The subscriber the engine's build connected before it started the engine."""
    sub, context = multi_llm.subscriber
    yield sub
    sub.close(linger=0)
    context.term()


@pytest.fixture(scope="module")
def events(subscriber):
    """``events(until=None)``: the KV events published since the last call, read until
    ``until(found)`` holds (or ``EVENTS_DEADLINE_S`` passed), or, without ``until``, until none came
    for 200 ms; ``events.seen``: all so far. vLLM publishes a step's events after the step, from a
    thread of its own: on a busy machine they may come later than the request's output."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def take(until=None) -> list:
        found = []
        deadline = time.monotonic() + EVENTS_DEADLINE_S
        while not (until and until(found)) and time.monotonic() < deadline:
            try:
                _topic, _seq, payload = subscriber.recv_multipart()
            except zmq.Again:
                if until is None:
                    break
                continue
            found += decoder.decode(payload).events
        take.seen += found
        return found

    take.seen = []
    return take


def graphchunk_events(found, kind) -> list:
    return [e for e in found if isinstance(e, kind) and e.medium == "graphchunk"]


def build_multi_llm():
    from vllm.config import KVEventsConfig, KVTransferConfig

    from graphchunk import GraphChunkLLM

    storage, port = engines.scratch("example-connector"), free_port()
    subscriber = subscribe(port)  # before the engine publishes anything
    transfer = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
        "connectors": [{"kv_connector": "GraphChunkConnector", "kv_role": "kv_consumer"},
                       {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
                        "kv_connector_extra_config": {"shared_storage_path": str(storage)}}]})
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}")
    llm = GraphChunkLLM(str(models.smollm2_path()), dtype="float32", max_model_len=1024,
                        kv_cache_memory_bytes=1 << 28, max_num_batched_tokens=512, block_size=32,
                        enable_prefix_caching=True, enforce_eager=True, kv_transfer_config=transfer,
                        kv_events_config=events, graphchunk={"pool_tokens": 4096, "mode": "isolated"})
    llm.storage, llm.subscriber = storage, subscriber
    return llm


multi_llm = engines.fixture(build_multi_llm, "multi_llm")


@pytest.fixture(scope="module")
def text(paragraphs, tokenizer):
    return joined_sources(paragraphs, tokenizer, 3, 4)  # this module's own engine: any source is fresh here


def test_a_segmented_request_is_graphchunks_and_exact(multi_llm, oracle, text, events):
    from vllm.distributed.kv_events import BlockStored

    prompt = RagPrompt(text.text(40), [text.text(70), text.text(90)], text.question(12))
    ids, boundaries = multi_llm.encode(prompt)
    before = multi_llm.stats()
    out = multi_llm.generate([prompt], sampling())[0]
    after = multi_llm.stats()
    assert (after["lookups"] - before["lookups"], after["misses"] - before["misses"]) == (2, 2)
    seg = split_at(ids, boundaries, **LIMITS)
    assert out.num_cached_tokens == seg.layout.context_len
    assert_matches_oracle(out, seg, oracle)
    stored = graphchunk_events(events(until=lambda found: len(graphchunk_events(found, BlockStored)) >= 3),
                               BlockStored)
    sys_tokens = list(seg.sys_tokens)
    assert [e.token_ids for e in stored] == [sys_tokens] + [sys_tokens + list(seg.chunk_tokens(i)) for i in range(2)]
    block_size = 32  # the engine's block_size
    assert all(len(e.block_hashes) == -(-len(e.token_ids) // block_size) and e.block_size == block_size
               and all(len(h) == 16 for h in e.block_hashes) for e in stored)


def test_the_other_connector_stores_and_serves_an_ordinary_prompt(multi_llm, text):
    ids = multi_llm.tokenizer.encode(" " + text.text(120), add_special_tokens=False)[:100]
    prompt = {"prompt_token_ids": ids}
    first = multi_llm.generate([prompt], sampling())[0]
    assert first.num_cached_tokens == 0
    assert any(multi_llm.storage.rglob("*.safetensors"))  # ExampleConnector stored it
    assert multi_llm.llm.reset_prefix_cache()  # vLLM's own cache only: the files and the pool stay
    again = multi_llm.generate([prompt], sampling())[0]
    assert again.num_cached_tokens == 96  # the prompt's whole blocks but the last token's, from disk
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)


def test_a_pool_reset_publishes_the_entries_removal(multi_llm, events):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    events()
    stored = {bytes(h) for e in graphchunk_events(events.seen, BlockStored) for h in e.block_hashes}
    assert len(stored) >= 3  # the segmented request's sys prompt and two chunks
    assert multi_llm.reset_pool()
    multi_llm.generate([{"prompt_token_ids": [1, 2, 3]}], sampling(1))  # a step: vLLM publishes after it

    def removed(found) -> set:
        return {bytes(h) for e in graphchunk_events(found, BlockRemoved) for h in e.block_hashes}

    assert removed(events(until=lambda found: removed(found) >= stored)) == stored
