"""``GraphChunkLLM``: ``vllm.LLM`` with graphchunk's worker, plus structured RAG prompts.

    with GraphChunkLLM() as llm:                       # the bundled SmolLM2 by default
        out = llm.generate(sys="...", chunks=["doc 1", "doc 2"], question="...")
        print(out[0].outputs[0].text, llm.stats())

        out = llm.chat([{"role": "user", "content": "..."}], documents=[{"text": "doc 1"}, {"text": "doc 2"}])

Structured prompts are tokenized segment by segment and sent with explicit boundaries, so no
separator reaches the model; ``chat(documents=...)`` makes each document a chunk exactly as the
OpenAI server does; plain prompts run as in vanilla vLLM, unless they ask to be split at a
separator (``separator="##"``, or the deployment's ``graphchunk={"separator": "##"}``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from graphchunk.config import GraphChunkConfig
from graphchunk.documents import document_messages, hf_render, place_documents
from graphchunk.engine.request_args import (BLOCK_ARG, BOUNDARIES_ARG, LAYERS_ARG, MODE_ARG, OFF, RATIO_ARG,
                                            RECOMPUTE_ARG, SEPARATOR_ARG, SINKS_ARG, SPREAD_ARG, TEMPERATURE_ARG,
                                            TOKENS_ARG)
from graphchunk.metrics import POOL_FIELDS, new_metrics_file, read_published


@dataclass(frozen=True)
class RagPrompt:
    """One request given as segments: ``sys`` ‖ ``chunks`` ‖ ``question``."""

    sys: str
    chunks: Sequence[str]
    question: str
    chat: bool = False
    """A chat turn: ``sys`` as the system message, ``question`` as the user's, ``chunks`` as its
    documents (``graphchunk.documents``: the chat template places them, or graphchunk leads the
    user message with them); one assistant turn follows."""
    extra: dict[str, Any] = field(default_factory=dict)
    """This prompt's ``SamplingParams.extra_args`` (e.g. ``{"graphchunk_mode": "blend"}``); they
    override the same keys given to ``generate`` / ``chat`` or in the sampling params."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt`` (one tenant): only requests with the same salt share KV, chunk-pool
    entries included (and blend entries taken from full prefills, ``blend_entries`` 'context')."""


class RequestFailed(RuntimeError):
    """A request of a ``generate`` or ``chat`` call finished with vLLM's finish reason 'error'.
    ``outputs``: every RequestOutput of the call, the failed ones included."""

    def __init__(self, message: str, outputs: list):
        super().__init__(message)
        self.outputs = outputs


def raise_failed(outputs: list) -> list:
    """``outputs``, unless one of them finished with vLLM's finish reason 'error' (then
    ``RequestFailed``, naming them and what graphchunk fails a request for)."""
    failed = [out.request_id for out in outputs if any(c.finish_reason == "error" for c in out.outputs)]
    if failed:
        raise RequestFailed(
            f"graphchunk: {len(failed)} of {len(outputs)} requests failed (finish reason 'error'): {failed}. "
            f"graphchunk fails a request whose context can never fit its chunk pool (raise graphchunk.pool_tokens) "
            f"or whose context fill failed its check more times than it is planned again (a bug: the log names the "
            f"pool entries); vLLM fails requests for its own reasons too. The log names the cause; every output is "
            f"in .outputs",
            outputs)
    return outputs


def encode_prompt(tokenizer, prompt: RagPrompt) -> tuple[list[int], list[int]]:
    """Token ids and segment boundaries (start of each chunk and of the question) of ``prompt``
    under ``tokenizer`` (a Hugging Face tokenizer): what ``GraphChunkLLM.encode`` sends, without
    an engine. A chat prompt is the documents request ``GraphChunkLLM.chat`` and the OpenAI server
    make of the same system prompt, chunks (as ``{"text": chunk}`` documents) and question."""
    if prompt.chat:
        documents = [{"text": chunk} for chunk in prompt.chunks]
        placed = place_documents(hf_render(tokenizer), document_messages(prompt.sys, prompt.question), documents,
                                 tokenizer, max_chunks=len(documents), max_chunk_len=1 << 62)  # the engine checks the limits
        return placed.token_ids, placed.boundaries
    texts = [prompt.sys, *prompt.chunks, prompt.question]
    # A plain prompt gets the tokenizer's BOS on sys.
    pieces = [tokenizer.encode(text, add_special_tokens=(i == 0)) if text else [] for i, text in enumerate(texts)]
    boundaries = np.cumsum([len(piece) for piece in pieces[:-1]]).tolist()
    return [t for piece in pieces for t in piece], boundaries


_MODE_KEYWORDS = {"mode": MODE_ARG, "recompute": RECOMPUTE_ARG, "recompute_ratio": RATIO_ARG,
                  "recompute_tokens": TOKENS_ARG, "recompute_sinks": SINKS_ARG, "recompute_spread": SPREAD_ARG,
                  "recompute_layers": LAYERS_ARG, "recompute_block": BLOCK_ARG, "key_temperature": TEMPERATURE_ARG,
                  "separator": SEPARATOR_ARG}


def _mode_args(**keywords) -> dict[str, Any]:
    """The extra_args of the per-call mode keywords (``_MODE_KEYWORDS``) that were given."""
    return {_MODE_KEYWORDS[name]: value for name, value in keywords.items() if value is not None}


class GraphChunkLLM:
    def __init__(self, model: str | None = None, *, graphchunk: dict[str, Any] | None = None, **llm_kwargs):
        """``graphchunk``: the settings of ``GraphChunkConfig``; ``llm_kwargs`` go to ``vllm.LLM``."""
        from vllm import LLM

        from graphchunk.engine.plugin import bind_annotator, register
        from graphchunk.reference import models

        register()  # vLLM loads it from the entry point too; this makes a source checkout work
        self.metrics_file = new_metrics_file()  # this engine's own, inherited by its worker
        self.config = GraphChunkConfig.from_dict(graphchunk)
        additional = dict(llm_kwargs.pop("additional_config", None) or {})
        additional["graphchunk"] = {**additional.get("graphchunk", {}), **(graphchunk or {})}
        self.llm = LLM(model=model or str(models.smollm2_path()), worker_cls="graphchunk.Runner",
                       additional_config=additional, **llm_kwargs)
        bind_annotator(self.llm.input_processor, self.metrics_file)  # this engine's pool, not a later one's
        self.tokenizer = self.llm.get_tokenizer()

    # --- generation --------------------------------------------------------------------------

    def generate(self, prompts=None, sampling_params=None, *, sys: str | None = None,
                 chunks: Sequence[str] | None = None, question: str | None = None, use_tqdm: bool = False,
                 mode: str | None = None, recompute: str | None = None, recompute_ratio: float | None = None,
                 recompute_tokens: int | None = None, recompute_sinks: int | None = None,
                 recompute_spread: str | None = None, recompute_layers: int | None = None,
                 recompute_block: int | None = None, key_temperature: float | None = None,
                 separator: str | None = None):
        """vLLM's RequestOutputs for ``prompts`` (strings, token prompts or ``RagPrompt``s), or for
        the single structured prompt given by ``sys`` / ``chunks`` / ``question``.

        ``mode`` ('isolated' or 'blend'), isolated mode's ``key_temperature``, and blend's
        ``recompute`` policy ('none', 'cacheblend', 'legolink', 'question'), ``recompute_ratio``,
        ``recompute_sinks`` and ``recompute_spread`` (cacheblend, question), ``recompute_layers``
        (question: the scoring pass's depth), ``recompute_block`` (cacheblend, question: picked in
        blocks of that many tokens) and ``recompute_tokens`` (legolink) apply to
        every prompt of the call; None leaves the deployment's default (``graphchunk={...}``).
        Precedence, lowest first: ``sampling_params.extra_args``, these keywords, a
        ``RagPrompt``'s own ``extra``. Recompute settings need blend mode (given here, per prompt
        or as the deployment's default); bad values raise ValueError naming the setting. An
        ordinary prompt (no chunks) runs as vanilla vLLM whatever the mode; ``separator`` (e.g.
        '##') splits plain prompts where it stands as a word inside a line; ``mode="off"`` runs
        every prompt, a ``RagPrompt``'s tokens included, as vanilla vLLM. A request that fails
        (finish reason 'error') raises ``RequestFailed``, which holds every output of the call."""
        from vllm import SamplingParams

        if prompts is None:
            if question is None:
                raise ValueError("give prompts, or sys/chunks/question")
            prompts = [RagPrompt(sys or "", list(chunks or []), question)]
        elif isinstance(prompts, (str, RagPrompt, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        call_args = _mode_args(mode=mode, recompute=recompute, recompute_ratio=recompute_ratio,
                               recompute_tokens=recompute_tokens, recompute_sinks=recompute_sinks,
                               recompute_spread=recompute_spread, recompute_layers=recompute_layers,
                               recompute_block=recompute_block, key_temperature=key_temperature,
                               separator=separator)
        inputs, all_params = [], []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            if call_args or isinstance(prompt, RagPrompt):
                p = p.clone()
                p.extra_args = {**(p.extra_args or {}), **call_args}
            if isinstance(prompt, RagPrompt):
                token_ids, boundaries = self.encode(prompt)
                p.extra_args = {**p.extra_args, **prompt.extra}
                if p.extra_args.get(MODE_ARG) != OFF:
                    p.extra_args[BOUNDARIES_ARG] = boundaries
                salt = prompt.cache_salt
                prompt = {"prompt_token_ids": token_ids}
                if salt is not None:
                    prompt["cache_salt"] = salt
            inputs.append(prompt)
            all_params.append(p)
        return raise_failed(self.llm.generate(inputs, all_params, use_tqdm=use_tqdm))

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False, *, documents: list[dict] | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             mode: str | None = None, recompute: str | None = None, recompute_ratio: float | None = None,
             recompute_tokens: int | None = None, recompute_sinks: int | None = None,
             recompute_spread: str | None = None, recompute_layers: int | None = None,
             recompute_block: int | None = None, key_temperature: float | None = None):
        """vLLM's ``LLM.chat`` for one conversation (a list of messages) or several. ``documents``
        (e.g. ``[{"title": ..., "text": ...}]``) become one chunk each, placed and tokenized exactly
        as the OpenAI server does for a chat completions request with the same ``documents``
        (``graphchunk.documents``); bad documents raise ValueError naming the document. ``mode``,
        ``key_temperature`` and the ``recompute*`` settings as in ``generate``; a failed request
        raises ``RequestFailed`` as there."""
        from vllm import SamplingParams

        params = (sampling_params or SamplingParams()).clone()
        params.extra_args = {**(params.extra_args or {}),
                             **_mode_args(mode=mode, recompute=recompute, recompute_ratio=recompute_ratio,
                                          recompute_tokens=recompute_tokens, recompute_sinks=recompute_sinks,
                                          recompute_spread=recompute_spread, recompute_layers=recompute_layers,
                                          recompute_block=recompute_block, key_temperature=key_temperature)}
        kwargs = dict(chat_template_kwargs or {})
        if documents is not None:
            kwargs["documents"] = documents
        return raise_failed(self.llm.chat(messages, params, use_tqdm=use_tqdm, chat_template=chat_template,
                                          chat_template_kwargs=kwargs or None))

    def encode(self, prompt: RagPrompt) -> tuple[list[int], list[int]]:
        """Token ids and segment boundaries (start of each chunk and of the question); see
        ``encode_prompt``, which needs only the tokenizer."""
        return encode_prompt(self.tokenizer, prompt)

    # --- lifecycle and metrics ----------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Chunk-cache metrics of the (first) worker, and the pool's as its scheduler last published
        them (the workers' copy is as of their last step)."""
        stats = self.llm.collective_rpc("graphchunk_stats")[0]
        published = read_published(self.metrics_file) or {}
        return {**stats, **{name: published[name] for name in POOL_FIELDS if name in published}}

    def reset_pool(self) -> bool:
        """Drops every unused chunk-pool entry (the persistent tier keeps its files), and vLLM's
        prefix cache with it (``reset_prefix_cache(reset_connector=True)``: the pool is graphchunk's
        KV connector's); False when vLLM refused (requests running). Call it between requests."""
        return self.llm.reset_prefix_cache(reset_connector=True)

    def templates_manifest(self) -> dict | None:
        """The grid's buckets, how many cached-chunk prefills ran on vLLM's graphs in each (replayed,
        padded, eager; ``outside_buckets``: steps no bucket holds) and what vLLM's graphs ran with;
        None without ``graphchunk.templates``."""
        return self.llm.collective_rpc("graphchunk_templates_manifest")[0]

    def published_stats(self) -> dict[str, float] | None:
        """The metrics the engine last published to its metrics file (the worker's after each step,
        the pool's where vLLM schedules); /metrics gets them through vLLM's connector metrics path."""
        return read_published(self.metrics_file)

    def shutdown(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None:
            engine.engine_core.shutdown()
            self.llm.llm_engine = None

    def __enter__(self) -> "GraphChunkLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
