"""vLLM general plugin (entry point ``vllm.general_plugins``): hooks request processing.

vLLM loads general plugins in every process; this one only wraps
``InputProcessor.process_inputs`` (idempotently), and the wrapper acts only for engines whose
worker is graphchunk's, so installing graphchunk changes nothing for other vLLM users.
"""
from __future__ import annotations

_ANNOTATOR = "_graphchunk_annotator"


def register() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(InputProcessor.process_inputs, "_graphchunk", False):
        return
    _export_metrics()
    original = InputProcessor.process_inputs
    RequestError = _request_error_class()

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        request = original(self, request_id, prompt, params, *args, **kwargs)
        annotator = _annotator(self)
        if annotator is not None:
            try:
                annotator.annotate(request)
            except ValueError as exc:
                raise RequestError(str(exc)) from exc
        return request

    process_inputs._graphchunk = True
    InputProcessor.process_inputs = process_inputs


def _request_error_class() -> type:
    """A client error for bad graphchunk input. vLLM 0.32's AsyncLLM turns any other exception
    from ``process_inputs`` (plain ValueError included) into EngineGenerateError, an HTTP 500
    with an empty message; VLLMValidationError passes through and becomes a 400 carrying the
    message. It stays a ValueError for ``GraphChunkLLM`` / ``vllm.LLM`` callers."""
    from vllm.exceptions import VLLMValidationError

    class GraphChunkRequestError(VLLMValidationError, ValueError):
        pass

    return GraphChunkRequestError


def _annotator(processor):
    annotator = getattr(processor, _ANNOTATOR, None)
    if annotator is None:
        from graphchunk.config import GraphChunkConfig
        from graphchunk.frontend import RequestAnnotator, is_graphchunk_worker

        config = processor.vllm_config
        annotator = False
        if is_graphchunk_worker(config.parallel_config.worker_cls):
            gc_config = GraphChunkConfig.from_additional_config(config.additional_config)
            annotator = RequestAnnotator(gc_config, processor.get_tokenizer())
        setattr(processor, _ANNOTATOR, annotator)
    return annotator or None


def _export_metrics() -> None:
    """In a main process (the API server, or a program using GraphChunkLLM): name a fresh
    metrics file for the worker to publish to, and serve it on /metrics. vLLM's engine-core and
    worker processes are multiprocessing children: they inherit the name instead."""
    import multiprocessing

    from graphchunk import metrics

    if multiprocessing.parent_process() is not None:
        return
    metrics.new_metrics_file()
    from prometheus_client import REGISTRY

    REGISTRY.register(metrics.PrometheusCollector())
