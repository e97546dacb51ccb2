"""The serving benchmark end to end at its ``--quick`` size (``perf/serving/bench_serve.py``), in
the suite's smallest form: vanilla vLLM and graphchunk's isolated server with a host-memory tier
(``--kinds vanilla,isolated/host=16777216 --no-precomputed``: two server starts, 5 passes) through vLLM's own ``vllm bench serve`` (the
benchmark's shim) on the tiny Llama checkpoint, concurrency 1, a few requests a pass, eager. Asserts
the result file's structure and what could go wrong whatever the timings: every row present and
every request completed, the documents arrived as documents (one chunk lookup each), warm passes hit
more than cold ones, vanilla's ceiling pass hits vLLM's prefix cache, and vanilla and graphchunk were
sent the same prompts, the /host= kind reached its server's settings, and the load sampled from
/metrics during each pass is there and sane. No timing is asserted.

What the suite leaves to the benchmark's own ``--quick`` (every kind, a precomputed tier): a blend
server and a server on a tier are the same code here with other settings (``settings_of``, below);
blend documents through the server are tests/test_server.py's, a precompute served from its tier
tests/test_tier.py's (the precompute's corpus lines are checked below without an engine).
"""
from __future__ import annotations

import json

import pytest

from inprocess import run_main
from perf.serving import bench_serve, serve_report

pytestmark = pytest.mark.slow

HOST_BYTES = 16 << 20
GC = f"isolated/host={HOST_BYTES}"
"""The graphchunk kind of the run: isolated mode over a host-memory tier (``/host=``)."""
PHASES = {"vanilla": ("cold", "warm", "ceiling"), GC: ("cold", "warm")}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-serve")
    argv = ["--quick", "--kinds", ",".join(PHASES), "--no-precomputed", "--out", str(out / "serve.json"),
            "--plot", str(out / "serve.png"), "--work-dir", str(out / "work")]
    done = run_main(bench_serve.main, argv, ["python", "-m", "perf.serving.bench_serve"])  # ``inprocess``
    print(done.stdout[-4000:])
    if not (out / "serve.json").exists():
        pytest.fail(f"bench_serve.py exited {done.returncode} without a result\n{done.stdout[-3000:]}\n"
                    f"{done.stderr[-3000:]}", pytrace=False)
    found = json.loads((out / "serve.json").read_text())
    found["_plot"] = out / "serve.png"
    return found


def rows_of(result, kind, phase):
    return sorted((r for r in result["rows"] if (r["kind"], r["phase"]) == (kind, phase)),
                  key=lambda r: r["concurrency"])


def test_structure(result):
    for key in ("command", "config", "model", "device", "environment", "sizes", "servers", "precompute", "checks"):
        assert key in result
    assert result["config"]["quick"] and result["config"]["concurrency"] == [1]
    assert result["environment"]["vllm"] and "graphchunk_commit" in result["environment"]
    assert result["sizes"]["pool_holds_working_set"]
    assert [s["name"] for s in result["servers"]] == ["vanilla", GC] and result["precompute"] is None
    assert f'"host_bytes": {HOST_BYTES}' in result["servers"][1]["command"]  # the /host= kind reached the server
    assert result["_plot"].stat().st_size > 0
    found = {(r["kind"], r["phase"], r["concurrency"]) for r in result["rows"]}
    assert found == {(k, p, 1) for k, phases in PHASES.items() for p in phases}
    for row in result["rows"]:
        assert row["request_throughput"] > 0 and row["ttft_ms"]["p50"] > 0 and row["ttft_ms"]["p99"] > 0
        assert row["tpot_ms"]["p50"] is not None
        if row["kind"] != "vanilla":
            assert set(row["vs_vanilla"]) >= {"request_throughput", "output_throughput", "ttft_p50_speedup"}
            assert set(row["gain_fraction"]) == {"request_throughput", "ttft_p50"}


def test_every_request_completed(result):
    for row in result["rows"]:
        assert row["completed"] == row["num_prompts"] > 0 and row["failed"] == 0, row
        assert row["output_tokens"] == row["num_prompts"] * result["config"]["output_len"], row  # --ignore-eos


def test_documents_arrived_as_documents(result):
    """A chunk lookup per document sent (the shim put them in the request's ``documents``); more
    only where chunked prefill splits a prompt over steps (each step looks its chunks up), never at
    concurrency 1 with these short prompts."""
    for row in result["rows"]:
        if row["kind"] != "vanilla":
            assert row["cache"]["chunk_lookups"] >= row["cache"]["documents_sent"] > 0, row
            if row["concurrency"] == 1:
                assert row["cache"]["chunk_lookups"] == row["cache"]["documents_sent"], row


def test_warm_hits_more_than_cold(result):
    for cold, warm in zip(rows_of(result, GC, "cold"), rows_of(result, GC, "warm")):
        assert warm["cache"]["chunk_hit_rate"] > cold["cache"]["chunk_hit_rate"], (cold["cache"], warm["cache"])


def test_the_load_was_sampled_during_each_pass(result):
    """Running and waiting requests, device KV blocks and (graphchunk) pool blocks: sampled at least
    once per pass, max >= median >= 0, never more running than the pass's concurrency, never more
    blocks held than the device has; the host level's hits counted (a number, on graphchunk's rows).
    A server's pool holds the entries its earlier passes computed, so every pass but its first
    samples pool blocks in use from its first read on (the first pass's may all come before its
    first entry: a quick pass lasts under a second)."""
    served = set()
    for row in result["rows"]:
        names = ("running", "waiting", "device_kv_blocks") + (("pool_blocks_used",) if row["kind"] != "vanilla" else ())
        for name in names:
            found = row[name]
            assert found["samples"] > 0 and found["max"] >= found["median"] >= 0, (name, row)
        assert row["running"]["max"] <= row["concurrency"], row
        assert 0 < row["device_kv_blocks_total"] and row["device_kv_blocks"]["max"] < row["device_kv_blocks_total"], row
        assert row["cache"]["preemptions"] is not None
        if row["kind"] == "vanilla":
            assert row["pool_blocks_used"] is None and row["cache"]["tier_host_hits"] is None, row
        else:
            assert row["cache"]["tier_host_hits"] >= 0, row
            assert row["kind"] not in served or row["pool_blocks_used"]["max"] > 0, row
            served.add(row["kind"])


def test_a_kind_takes_a_pool_share_and_a_host_level(tokenizer):
    """``KIND/pool=SHARE/host=BYTES``: the pool's tokens at that share and ``host_bytes`` in the
    server's graphchunk settings (no directory); bad options are refused."""
    from perf.common import harness as H
    from perf.serving.bench_serve import QUICK, build_parser, server_settings
    from perf.serving.serve_kinds import kind_options, pool_tokens_at, settings_of

    from graphchunk.config import GraphChunkConfig

    args = H.parse_with_quick(build_parser(), ["--quick"], QUICK)
    model = H.resolve_model(args.model)
    kind = "blend/pool=0.25/host=1073741824"
    assert kind_options(kind) == ("blend", {"pool": 0.25, "host": 1073741824})
    settings = server_settings(args, model, kind)
    assert settings == {"mode": "blend", "host_bytes": 1073741824, "pool_tokens": pool_tokens_at(args, model, 0.25)}
    assert 0 < settings["pool_tokens"] < pool_tokens_at(args, model, 0.5)
    config = GraphChunkConfig.from_dict(settings)
    assert config.host_bytes == 1073741824 and not config.store_path
    assert settings_of("isolated/host=4096") == {"mode": "isolated", "host_bytes": 4096}
    assert server_settings(args, model, "vanilla") is None
    for bad in ("vanilla/host=4096", "blend/host=0", "blend/host=1.5", "blend/host=4096/host=4096", "blend/pool=1",
                "blend/other=1", "blend/host"):
        with pytest.raises(ValueError):
            settings_of(bad)


def test_the_precompute_corpus_holds_every_document_under_every_system_prompt(tokenizer, tmp_path):
    """What the precomputed pass's ``graphchunk-precompute --format documents`` reads (without its
    engine): every document of every level once per system prompt in isolated mode (entries are keyed
    by it), once in blend mode (the contextualized corpus: blend only), grouped by the tool's own reader."""
    import random

    from graphchunk.tools.precompute import read_corpus
    from perf.common import harness as H
    from perf.serving import serve_trace as T
    from perf.serving.bench_serve import QUICK, build_parser, precompute_lines

    args = H.parse_with_quick(build_parser(), ["--quick"], QUICK)
    levels = T.build_levels(tokenizer, args.concurrency, args, random.Random(0))
    docs = [doc for level in levels for doc in level.docs]
    for context, modes in ((False, {(s, "isolated") for s in T.SYSTEMS}), (True, set())):
        path = T.write_jsonl(tmp_path / f"corpus-{context}.jsonl", precompute_lines(levels, context))
        groups = read_corpus(path, "", "isolated")
        assert set(groups) == modes | {(T.SYSTEMS[0], "blend")}, context
        assert all(group == docs for group in groups.values())


def test_ceiling_hits_the_prefix_cache(result):
    for ceiling, warm in zip(rows_of(result, "vanilla", "ceiling"), rows_of(result, "vanilla", "warm")):
        assert ceiling["cache"]["prefix_cache_hits"] > 0
        assert ceiling["cache"]["prefix_cache_hit_rate"] > warm["cache"]["prefix_cache_hit_rate"]


def test_vanilla_and_graphchunk_got_the_same_prompts(result):
    """Same text; the counts as the two tokenizations give them (graphchunk tokenizes segment by
    segment: at most one token fewer per document, predicted request by request)."""
    assert result["checks"]["same_prompt_text_as_vanilla"]
    assert result["checks"]["prompt_tokens_as_expected"]
    k = result["config"]["docs_per_prompt"]
    for row in result["rows"]:
        if row["kind"] != "vanilla":
            low, high = row["prompt_tokens_vs_vanilla"]["vanilla_minus_graphchunk"]
            assert 0 <= low <= high <= k and row["prompt_tokens_vs_vanilla"]["as_expected"], row


def test_every_check_passed(result):
    assert all(ok is not False for ok in result["checks"].values()), result["checks"]


def test_a_blend_kind_names_its_recompute_policy():
    """``blend:POLICY`` serves blend with that policy as the deployment's default; a bad one is refused."""
    from perf.serving.serve_kinds import on_corpus, settings_of, tenant_of

    from graphchunk.config import GraphChunkConfig

    settings = settings_of("blend:question:0.15+2@4")
    assert settings == {"mode": "blend", "recompute": "question", "recompute_ratio": 0.15, "recompute_sinks": 2,
                        "recompute_layers": 4, "recompute_block": 1}  # single tokens, as the label says
    assert GraphChunkConfig.from_dict(settings).policy.describe() == "question:0.15+sinks:2@4"
    assert settings_of("blend:legolink:15") == {"mode": "blend", "recompute": "legolink", "recompute_tokens": 15}
    assert settings_of("isolated") == {"mode": "isolated"} and settings_of("vanilla") is None
    prefixed = settings_of("blend-prefix:question:0.15")
    assert prefixed["blend_prefix"] and GraphChunkConfig.from_dict(prefixed).blend_prefix == prefixed["blend_prefix"]
    assert settings_of("blend-context") == {"mode": "blend", "blend_entries": "context"}
    # Its requests carry one tenant's cache_salt (graphchunk captures entries under a salt only).
    assert tenant_of("blend-context:question:0.15") and not tenant_of("blend") and not tenant_of("vanilla")
    # The contextualized corpus serves requests without a salt: blend mode on the precomputed tier.
    assert settings_of("blend-corpus:question:0.15") == {"mode": "blend", "recompute": "question",
                                                         "recompute_ratio": 0.15, "recompute_block": 1}
    assert on_corpus("blend-corpus:question:0.15") and not on_corpus("blend") and not tenant_of("blend-corpus")
    for bad in ("blend-prefix:vanilla", "blend:vanilla", "blend:isolated:0.8", "other", "blend:question:x"):
        with pytest.raises((ValueError, SystemExit)):
            settings_of(bad)


def test_documents_arrived_allows_only_full_prefilled_requests_documents_unlooked():
    """A pass's documents are looked up, but a full-prefilled request's may not be (5 documents a
    request here): 315 lookups of 320 pass with one full prefill, not without; at concurrency 1 the
    lookups are exact."""
    def row(lookups, full_prefills, concurrency=16):
        return {"num_prompts": 64, "concurrency": concurrency,
                "cache": {"documents_sent": 320, "chunk_lookups": lookups, "blend_full_prefills": full_prefills}}

    assert serve_report.documents_arrived(row(320, 0)) and serve_report.documents_arrived(row(330, 0))
    assert serve_report.documents_arrived(row(315, 1)) and not serve_report.documents_arrived(row(315, 0))
    assert not serve_report.documents_arrived(row(310, 1))
    assert not serve_report.documents_arrived(row(330, 0, concurrency=1))
