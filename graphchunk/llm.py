"""``GraphChunkLLM``: ``vllm.LLM`` with graphchunk's worker, plus structured RAG prompts.

    with GraphChunkLLM() as llm:                       # the bundled SmolLM2 by default
        out = llm.generate(sys="...", chunks=["doc 1", "doc 2"], question="...")
        print(out[0].outputs[0].text, llm.stats())

Structured prompts are tokenized segment by segment and sent with explicit boundaries, so no
separator reaches the model; plain prompts (with or without separators) go through unchanged.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from graphchunk.config import GraphChunkConfig
from graphchunk.engine.frontend import (BOUNDARIES_ARG, MODE_ARG, RATIO_ARG, RECOMPUTE_ARG, TEMPERATURE_ARG,
                                        TOKENS_ARG)
from graphchunk.metrics import new_metrics_file, read_published


@dataclass(frozen=True)
class RagPrompt:
    """One request given as segments: ``sys`` ‖ ``chunks`` ‖ ``question``."""

    sys: str
    chunks: Sequence[str]
    question: str
    chat: bool = False
    """Wrap the segments in the model's chat template (system; documents + question as the
    user turn; one assistant turn follows)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """This prompt's ``SamplingParams.extra_args`` (e.g. ``{"graphchunk_mode": "blend"}``); they
    override the same keys given to ``generate`` / ``chat`` or in the sampling params."""


_MARK = "\x00graphchunk-{}\x00"


def encode_prompt(tokenizer, prompt: RagPrompt) -> tuple[list[int], list[int]]:
    """Token ids and segment boundaries (start of each chunk and of the question) of ``prompt``
    under ``tokenizer`` (a Hugging Face tokenizer): what ``GraphChunkLLM.encode`` sends, without
    an engine."""
    texts = chat_segments(tokenizer, prompt) if prompt.chat else [prompt.sys, *prompt.chunks, prompt.question]
    # A chat template writes its own BOS; a plain prompt gets the tokenizer's on sys.
    pieces = [tokenizer.encode(text, add_special_tokens=(i == 0 and not prompt.chat)) if text else []
              for i, text in enumerate(texts)]
    boundaries = np.cumsum([len(piece) for piece in pieces[:-1]]).tolist()
    return [t for piece in pieces for t in piece], boundaries


def chat_segments(tokenizer, prompt: RagPrompt) -> list[str]:
    """The chat template rendered around markers and cut there. Template text after the system
    prompt stays with sys; after a document (the "\n\n" joining them), with that document, so a
    document's tokens are the same wherever it appears; the assistant header, with the question."""
    contents = [prompt.sys, *prompt.chunks, prompt.question]
    marks = [_MARK.format(i) for i in range(len(contents))]
    messages = [{"role": "system", "content": marks[0]}, {"role": "user", "content": "\n\n".join(marks[1:])}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = re.split("|".join(map(re.escape, marks)), rendered)
    if len(parts) != len(marks) + 1:
        raise ValueError("the chat template does not keep the system and user messages verbatim")
    return [parts[0] + contents[0] + parts[1]] + [c + p for c, p in zip(contents[1:], parts[2:])]


class GraphChunkLLM:
    def __init__(self, model: str | None = None, *, graphchunk: dict[str, Any] | None = None, **llm_kwargs):
        """``graphchunk``: the settings of ``GraphChunkConfig``; ``llm_kwargs`` go to ``vllm.LLM``."""
        from vllm import LLM

        from graphchunk.engine.plugin import register
        from graphchunk.reference import models

        register()  # vLLM loads it from the entry point too; this makes a source checkout work
        self.metrics_file = new_metrics_file()  # this engine's own, inherited by its worker
        self.config = GraphChunkConfig.from_dict(graphchunk)
        additional = dict(llm_kwargs.pop("additional_config", None) or {})
        additional["graphchunk"] = {**additional.get("graphchunk", {}), **(graphchunk or {})}
        self.llm = LLM(model=model or str(models.smollm2_path()), worker_cls="graphchunk.Runner",
                       additional_config=additional, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()

    # --- generation --------------------------------------------------------------------------

    def generate(self, prompts=None, sampling_params=None, *, sys: str | None = None,
                 chunks: Sequence[str] | None = None, question: str | None = None, use_tqdm: bool = False,
                 mode: str | None = None, recompute: str | None = None, recompute_ratio: float | None = None,
                 recompute_tokens: int | None = None, key_temperature: float | None = None):
        """vLLM's RequestOutputs for ``prompts`` (strings, token prompts or ``RagPrompt``s), or for
        the single structured prompt given by ``sys`` / ``chunks`` / ``question``.

        ``mode`` ('isolated' or 'blend'), isolated mode's ``key_temperature``, and blend's
        ``recompute`` policy ('none', 'cacheblend', 'legolink', 'question'), ``recompute_ratio``
        (cacheblend, question) and ``recompute_tokens`` (legolink) apply to
        every prompt of the call; None leaves the deployment's default (``graphchunk={...}``).
        Precedence, lowest first: ``sampling_params.extra_args``, these keywords, a
        ``RagPrompt``'s own ``extra``. Recompute settings need blend mode (given here, per prompt
        or as the deployment's default); bad values raise ValueError naming the setting. An
        ordinary prompt (no chunks) runs as vanilla vLLM whatever the mode."""
        from vllm import SamplingParams

        if prompts is None:
            if question is None:
                raise ValueError("give prompts, or sys/chunks/question")
            prompts = [RagPrompt(sys or "", list(chunks or []), question)]
        elif isinstance(prompts, (str, RagPrompt, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        call_args = {key: value for key, value in ((MODE_ARG, mode), (RECOMPUTE_ARG, recompute),
                                                   (RATIO_ARG, recompute_ratio), (TOKENS_ARG, recompute_tokens),
                                                   (TEMPERATURE_ARG, key_temperature))
                     if value is not None}
        inputs, all_params = [], []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            if call_args or isinstance(prompt, RagPrompt):
                p = p.clone()
                p.extra_args = {**(p.extra_args or {}), **call_args}
            if isinstance(prompt, RagPrompt):
                token_ids, boundaries = self.encode(prompt)
                p.extra_args = {**p.extra_args, **prompt.extra, BOUNDARIES_ARG: boundaries}
                prompt = {"prompt_token_ids": token_ids}
            inputs.append(prompt)
            all_params.append(p)
        return self.llm.generate(inputs, all_params, use_tqdm=use_tqdm)

    def chat(self, sys: str, chunks: Sequence[str], question: str, sampling_params=None, use_tqdm: bool = False,
             *, mode: str | None = None, recompute: str | None = None, recompute_ratio: float | None = None,
             recompute_tokens: int | None = None, key_temperature: float | None = None):
        """One assistant turn answering ``question`` from ``chunks`` under the system prompt ``sys``;
        ``mode``, ``key_temperature`` and the ``recompute*`` settings as in ``generate``."""
        return self.generate(RagPrompt(sys, list(chunks), question, chat=True), sampling_params, use_tqdm=use_tqdm,
                             mode=mode, recompute=recompute, recompute_ratio=recompute_ratio,
                             recompute_tokens=recompute_tokens, key_temperature=key_temperature)

    def encode(self, prompt: RagPrompt) -> tuple[list[int], list[int]]:
        """Token ids and segment boundaries (start of each chunk and of the question); see
        ``encode_prompt``, which needs only the tokenizer."""
        return encode_prompt(self.tokenizer, prompt)

    # --- lifecycle and metrics ----------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Chunk-cache metrics of the (first) worker."""
        return self.llm.collective_rpc("graphchunk_stats")[0]

    def reset_pool(self) -> int:
        """Drops every cached chunk-pool entry (the persistent tier keeps its files); returns how
        many (first worker). Call it between requests, as vLLM's ``reset_prefix_cache``."""
        return self.llm.collective_rpc("graphchunk_reset_pool")[0]

    def templates_manifest(self) -> dict | None:
        """The grid's buckets, how many cached-chunk prefills ran on vLLM's graphs in each (replayed,
        padded, eager; ``outside_buckets``: steps no bucket holds) and what vLLM's graphs ran with;
        None without ``graphchunk.templates``."""
        return self.llm.collective_rpc("graphchunk_templates_manifest")[0]

    def published_stats(self) -> dict[str, float] | None:
        """The metrics as /metrics exports them (published by the worker after each step)."""
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
