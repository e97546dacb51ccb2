"""Chat requests' ``documents`` through vLLM's renderer, for graphchunk engines only.

vLLM hands a chat request's documents (the ``documents`` field, or
``chat_template_kwargs.documents``; the Python ``LLM.chat`` through ``chat_template_kwargs``) to
the chat template in ``HfRenderer.render_messages``. For a graphchunk engine this hook renders
them with ``documents.place_documents`` instead: the prompt comes back as token ids, one chunk
per document, and the segment boundaries ride on the prompt dict (``DOCUMENTS_KEY``) through
vLLM's tokenization step (``BaseRenderer._process_singleton``, which builds the engine input) to
``InputProcessor.process_inputs``, where ``RequestAnnotator.annotate`` takes them
(``frontend.DocumentBoundaries``). The server (``/v1/chat/completions``) and ``LLM.chat`` run
the same code, so both produce the same tokens. A user message's content parts can be the
documents too (``documents.place_document_parts``: parts marked ``"graphchunk_document": true``,
or every part but the last with ``chat_template_kwargs.graphchunk_document_parts``). Other
renderers (Mistral's, DeepSeek's, Cohere's melody with ``--tokenizer-mode cohere``) render
chats without a template graphchunk can probe: their documents requests are refused, never run
as prompts graphchunk cannot chunk (nor separator-split). With ``documents_fallback='ordinary'``
a documents request graphchunk cannot chunk (``documents.Unchunkable``, or another renderer's)
runs as an ordinary prompt instead, marked ``UNCHUNKED`` so that ``annotate`` runs no separator
detection on it and the worker counts it. vLLM's scale-out render endpoint hands the boundaries on
in its answer's sampling params, for ``/inference/v1/generate``.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses

from graphchunk.engine.frontend import DOCUMENTS_KEY, DocumentBoundaries
from graphchunk.engine.request_args import BOUNDARIES_ARG

_SETTINGS = "_graphchunk_document_settings"
UNCHUNKED = DocumentBoundaries((), 0)
"""A documents request run as an ordinary prompt (``documents_fallback='ordinary'``)."""
_RENDERED: contextvars.ContextVar[DocumentBoundaries | None] = contextvars.ContextVar(
    "graphchunk_rendered_documents", default=None)
"""The boundaries of the documents request this task's ``render_chat_async`` rendered last (set by
the one wrapper of ``render_chat`` that sees the engine inputs, ``_refuse_other_renderers``; read
by ``_carry_into_render_endpoint``)."""


def install(request_error: type) -> None:
    from vllm.renderers.base import BaseRenderer
    from vllm.renderers.hf import HfRenderer

    if getattr(HfRenderer.render_messages, "_graphchunk", False):
        return
    render_messages = HfRenderer.render_messages

    def render_with_documents(self, messages, params):
        settings = _documents_settings(self, messages, params)
        if settings is None:
            return render_messages(self, messages, params)
        try:
            return _render(self, render_messages, messages, params, settings)
        except ValueError as exc:
            raise request_error(str(exc)) from exc

    async def render_with_documents_async(self, messages, params):
        if _documents_settings(self, messages, params) is None:
            return await render_messages_async(self, messages, params)
        # off the event loop, under vLLM's template-render timeout (VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT)
        return await self._render_with_timeout(asyncio.to_thread(render_with_documents, self, messages, params))

    render_messages_async = HfRenderer.render_messages_async
    for name, fn in (("render_messages", render_with_documents),
                     ("render_messages_async", render_with_documents_async)):
        fn._graphchunk = True
        setattr(HfRenderer, name, fn)
    _carry_through(BaseRenderer)
    _refuse_other_renderers(BaseRenderer, HfRenderer, request_error)
    _carry_into_render_endpoint()


def _refuse_other_renderers(base, hf_renderer, request_error) -> None:
    """Documents requests to a graphchunk engine whose renderer is not vLLM's HF one: a clear
    error, or (``documents_fallback='ordinary'``) ordinary prompts marked ``UNCHUNKED``. The same
    wrapper records a single prompt's boundaries in ``_RENDERED`` for the render endpoint."""
    def unchunked(renderer, conversations, chat_params) -> list[bool]:
        """Which conversations are documents requests this renderer cannot chunk; raises unless
        the engine's ``documents_fallback`` runs them as ordinary prompts."""
        if isinstance(renderer, hf_renderer):
            return []
        settings = [_documents_settings(renderer, conversation, chat_params) for conversation in conversations]
        if any(s is not None and s.documents_fallback != "ordinary" for s in settings):
            raise request_error(f"graphchunk finds documents in what vLLM's Hugging Face chat-template renderer "
                                f"renders; this model's chats are rendered by {type(renderer).__name__} "
                                "(--tokenizer-mode): send the documents in the prompt, or serve with "
                                "--tokenizer-mode hf")
        return [s is not None for s in settings]

    def marked(rendered, which: list[bool]):
        for engine_input, ordinary in zip(rendered[1], which):
            if ordinary:
                engine_input[DOCUMENTS_KEY] = UNCHUNKED
        carried = [engine_input.get(DOCUMENTS_KEY) for engine_input in rendered[1] if isinstance(engine_input, dict)]
        _RENDERED.set(carried[0] if len(carried) == 1 else None)
        return rendered

    render_chat, render_chat_async = base.render_chat, base.render_chat_async

    def checked_render_chat(self, conversations, chat_params, *args, **kwargs):
        which = unchunked(self, conversations, chat_params)
        return marked(render_chat(self, conversations, chat_params, *args, **kwargs), which)

    async def checked_render_chat_async(self, conversations, chat_params, *args, **kwargs):
        which = unchunked(self, conversations, chat_params)
        return marked(await render_chat_async(self, conversations, chat_params, *args, **kwargs), which)

    base.render_chat, base.render_chat_async = checked_render_chat, checked_render_chat_async


def _render(renderer, render_messages, messages, params, settings):
    """(conversation, tokens prompt) of a documents request; the conversation is the one vLLM
    parsed for the prompt actually sent (not one of ``place_documents``' marker renders)."""
    from graphchunk.documents import (DOCUMENT_PARTS, DocumentError, Unchunkable, marks_document_parts,
                                      place_document_parts, place_documents, unchunked_text)

    conversations = []

    def render(msgs, docs):
        kwargs = {key: value for key, value in params.chat_template_kwargs.items()
                  if key not in ("documents", DOCUMENT_PARTS)}
        if docs is not None:
            kwargs["documents"] = docs
        conversation, prompt = render_messages(renderer, msgs, dataclasses.replace(params, chat_template_kwargs=kwargs))
        if prompt.get("multi_modal_data") or not isinstance(prompt.get("prompt"), str):
            raise ValueError("documents requests need the chat template's text: no images or other non-text "
                             "inputs, and no prompt embeddings (--enable-prompt-embeds)")
        conversations.append((prompt["prompt"], conversation))
        return prompt["prompt"]

    documents = params.chat_template_kwargs.get("documents")
    every_part = params.chat_template_kwargs.get(DOCUMENT_PARTS, False)
    if not isinstance(every_part, bool):
        raise DocumentError(f"{DOCUMENT_PARTS} must be true or false, got {every_part!r:.40}")
    in_parts = every_part or marks_document_parts(messages)
    if in_parts and documents:
        raise DocumentError("send documents either in the documents field or as content parts, not both")

    def place(max_chunks: int, max_chunk_len: int):
        if in_parts:
            return place_document_parts(render, messages, renderer.get_tokenizer(), every_part=every_part,
                                        max_chunks=max_chunks, max_chunk_len=max_chunk_len)
        return place_documents(render, messages, documents, renderer.get_tokenizer(), max_chunks=max_chunks,
                               max_chunk_len=max_chunk_len)

    try:
        placed = place(settings.max_chunks, settings.max_chunk_len)
        prompt = {"prompt_token_ids": placed.token_ids, "prompt": placed.text,
                  DOCUMENTS_KEY: DocumentBoundaries(tuple(placed.boundaries), len(placed.token_ids))}
    except Unchunkable:
        if settings.documents_fallback != "ordinary":
            raise
        text = render(messages, None) if in_parts else unchunked_text(render, messages, documents)
        prompt = {"prompt": text, DOCUMENTS_KEY: UNCHUNKED}
    return next(conv for text, conv in conversations if text == prompt["prompt"]), prompt


def _carry_into_render_endpoint() -> None:
    """vLLM's scale-out render endpoint (``/v1/chat/completions/render``, ``--enable-scale-out``)
    answers with the prompt's token ids and sampling params for ``/inference/v1/generate``: a
    documents request's boundaries go into those params as ``graphchunk_boundaries`` (an
    unchunked one's: ``[0]``, an ordinary prompt without separator detection), so the generate
    request is chunked exactly as the chat request would be."""
    try:
        from vllm.entrypoints.scale_out.render.serving import ServingRender
    except ImportError:  # no scale-out endpoints in this vLLM
        return
    render_chat_request = ServingRender.render_chat_request

    async def with_boundaries(self, request, raw_request=None, *args, **kwargs):
        _RENDERED.set(None)  # vLLM 0.33 added engine_chat_template_kwargs: forwarded as given
        result = await render_chat_request(self, request, raw_request, *args, **kwargs)
        carried, params = _RENDERED.get(), getattr(result, "sampling_params", None)
        if carried is not None and params is not None:
            params.extra_args = {**(params.extra_args or {}), BOUNDARIES_ARG: list(carried.boundaries) or [0]}
        return result

    ServingRender.render_chat_request = with_boundaries


def _carry_through(base) -> None:
    """The boundaries from the tokens prompt to the engine input it becomes."""
    process, process_async = base._process_singleton, base._process_singleton_async

    def _process_singleton(self, prompt, **kwargs):
        carried = prompt.pop(DOCUMENTS_KEY, None) if isinstance(prompt, dict) else None
        engine_input = process(self, prompt, **kwargs)
        if carried is not None:
            engine_input[DOCUMENTS_KEY] = carried
        return engine_input

    async def _process_singleton_async(self, prompt, **kwargs):
        carried = prompt.pop(DOCUMENTS_KEY, None) if isinstance(prompt, dict) else None
        engine_input = await process_async(self, prompt, **kwargs)
        if carried is not None:
            engine_input[DOCUMENTS_KEY] = carried
        return engine_input

    base._process_singleton, base._process_singleton_async = _process_singleton, _process_singleton_async


def _documents_settings(renderer, messages, params):
    """The engine's GraphChunkConfig for a documents request to a graphchunk engine, else None: one
    with ``documents``, or with documents as content parts (``DOCUMENT_PARTS`` or ``DOCUMENT_PART``)."""
    from graphchunk.documents import asks_for_documents

    return _settings(renderer) if asks_for_documents(params.chat_template_kwargs, messages) else None


def _settings(renderer):
    """The engine's GraphChunkConfig, or None when its worker is not graphchunk's."""
    settings = getattr(renderer, _SETTINGS, None)
    if settings is None:
        from graphchunk.config import GraphChunkConfig
        from graphchunk.engine.frontend import is_graphchunk_worker

        config = renderer.config
        settings = (GraphChunkConfig.from_additional_config(config.additional_config)
                    if is_graphchunk_worker(config.parallel_config.worker_cls) else False)
        setattr(renderer, _SETTINGS, settings)
    return settings or None
