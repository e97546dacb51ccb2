"""vLLM general plugin (entry point ``vllm.general_plugins``): hooks request processing.

vLLM loads general plugins in every process; this one wraps ``InputProcessor.process_inputs``,
the renderer's chat rendering for documents requests (``document_hooks``), for the OpenAI server ``GenerateBaseServing._with_kv_transfer_rejection_cleanup``,
``VllmConfig._get_v2_model_runner_unsupported_features``, ``EngineArgs.create_engine_config``,
``EngineCore.preprocess_add_request`` and ``Scheduler.update_from_output`` (each idempotently), and every wrapper
acts only for engines whose worker is graphchunk's, so installing graphchunk changes nothing for
other vLLM users. Under a vLLM graphchunk does not admit (``compat.release``) it installs nothing and
logs why: some of what it wraps is gone there (vLLM 0.34's ``VllmConfig`` has no V2-runner
selection), and vLLM calls a general plugin unguarded, so a failure here would stop every engine;
a graphchunk engine is still refused, by its worker's start-up check.
"""
from __future__ import annotations

_ANNOTATOR = "_graphchunk_annotator"


def register() -> None:
    from graphchunk.compat import UnsupportedVLLM, release

    try:
        release()
    except UnsupportedVLLM as exc:
        from graphchunk.log import logger

        logger.warning("graphchunk's plugin installs nothing: %s", exc)
        return
    from vllm.v1.engine.input_processor import InputProcessor

    from graphchunk.engine import connector, document_hooks
    from graphchunk.engine.frontend import DOCUMENTS_KEY

    if getattr(InputProcessor.process_inputs, "_graphchunk", False):
        return
    _name_metrics_file()
    original = InputProcessor.process_inputs
    RequestError = _request_error_class()

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        documents = prompt.pop(DOCUMENTS_KEY, None) if isinstance(prompt, dict) else None
        request = original(self, request_id, prompt, params, *args, **kwargs)
        annotator = _annotator(self)
        if annotator is not None:
            try:
                annotator.annotate(request, documents)
            except ValueError as exc:
                raise RequestError(str(exc)) from exc
        return request

    process_inputs._graphchunk = True
    InputProcessor.process_inputs = process_inputs
    connector.register()
    document_hooks.install(RequestError)
    _guard_request_bodies()
    _select_v1_model_runner()
    _check_config_before_start()
    _distinct_sibling_salts()
    _retry_failed_fills()


def _retry_failed_fills() -> None:
    """Before vLLM's scheduler processes a step's output, graphchunk's connector puts the requests
    that read a failed context fill back in vLLM's queue (``GraphChunkConnector.before_output``,
    ``fill_retry.py``): vLLM's connector interface is told of a step's output only after vLLM has
    delivered its tokens. Only for schedulers with graphchunk's connector."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from graphchunk.engine.connector import graphchunk_connector

    original = Scheduler.update_from_output
    if getattr(original, "_graphchunk", False):
        return

    def update_from_output(self, scheduler_output, model_runner_output):
        connector = graphchunk_connector(getattr(self, "connector", None))
        output = model_runner_output.kv_connector_output
        if connector is not None and output is not None:
            connector.before_output(self, output)
        return original(self, scheduler_output, model_runner_output)

    update_from_output._graphchunk = True
    Scheduler.update_from_output = update_from_output


def _distinct_sibling_salts() -> None:
    """A ranking blend policy's salt carries a nonce (``frontend.blend_fingerprint``) so that vLLM's
    prefix cache never hands one request another's blended KV; but vLLM annotates a request with
    ``n > 1`` once and copies it into its children (``AsyncLLM.add_request``, ``LLMEngine``), so
    siblings would share that nonce, and a sibling scheduled in the step after another's allocation
    would take a prefix hit on its blocks and rank only the rest. The engine core appends each
    request's own id (unique per child) to such a salt before building vLLM's ``Request`` (whose
    block hashes read it), for graphchunk engines only."""
    from vllm.v1.engine.core import EngineCore

    from graphchunk.engine.frontend import NONCE_MARK, SALT_MARK, is_graphchunk_worker

    original = EngineCore.preprocess_add_request
    if getattr(original, "_graphchunk", False):
        return

    def preprocess_add_request(self, request):
        salt = request.cache_salt or ""
        if SALT_MARK in salt and NONCE_MARK in salt.rpartition(SALT_MARK)[2] and \
                is_graphchunk_worker(self.vllm_config.parallel_config.worker_cls):
            request.cache_salt = f"{salt}:{request.request_id}"
        return original(self, request)

    preprocess_add_request._graphchunk = True
    EngineCore.preprocess_add_request = preprocess_add_request


def _check_config_before_start() -> None:
    """Runs graphchunk's start-up checks (``worker.check_config``) where the engine's config is
    built, after giving a grid of backend ``vllm`` to vLLM's graph machinery (``graph_config``),
    in the user's process: a refused configuration raises ConfigError with its message
    there, at once, instead of in a worker process whose failure the user sees as "Engine core
    initialization failed" (the worker checks again; it also serves configs built elsewhere)."""
    from vllm.engine.arg_utils import EngineArgs

    from graphchunk.engine.frontend import is_graphchunk_worker

    original = EngineArgs.create_engine_config
    if getattr(original, "_graphchunk", False):
        return

    def create_engine_config(self, *args, **kwargs):
        from graphchunk.config import GraphChunkConfig
        from graphchunk.engine import graph_config
        from graphchunk.graphs.buckets import load_grid

        grid = None
        if is_graphchunk_worker(self.worker_cls):
            from graphchunk.engine.connector import connector_config

            settings = GraphChunkConfig.from_additional_config(self.additional_config)
            _refuse_precompute_serving(self, settings)
            self.kv_transfer_config = connector_config(self.kv_transfer_config)
            templates = settings.templates
            grid = load_grid(templates) if templates else None
            if grid is not None:
                graph_config.request_graph_mode(self, grid, graph_config.platform_kind())
        config = original(self, *args, **kwargs)
        if is_graphchunk_worker(config.parallel_config.worker_cls):
            from graphchunk.engine.worker import check_config

            if grid is not None:
                graph_config.add_capture_sizes(config, grid, graph_config.platform_kind())
            check_config(config, GraphChunkConfig.from_additional_config(config.additional_config))
        return config

    create_engine_config._graphchunk = True
    EngineArgs.create_engine_config = create_engine_config


def _refuse_precompute_serving(engine_args, settings) -> None:
    """``blend_entries`` 'precompute' lets each request choose the context of the entries every
    unsalted request reads (DESIGN.md §2): only ``graphchunk-precompute``'s offline engine, whose
    requests are the operator's corpus, may run it; an engine serving clients (vLLM builds its
    config from ``AsyncEngineArgs``: ``vllm serve``, ``AsyncLLM``) refuses it."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from graphchunk.config import ConfigError

    if settings.blend_entries == "precompute" and isinstance(engine_args, AsyncEngineArgs):
        raise ConfigError("graphchunk.blend_entries 'precompute' is graphchunk-precompute's offline setting: on an "
                          "engine serving clients each request would choose the context of the blend entries every "
                          "request without a cache_salt reads; use 'alone' or 'context' (docs/tier.md)")


def _select_v1_model_runner() -> None:
    """vLLM 0.32 runs its V2 model runner whenever Triton imports (every CUDA install), unless the
    configuration uses a feature V2 lacks; graphchunk's runner extends the V1 runner. A graphchunk
    engine reports itself as such a feature, so vLLM's own selection picks V1 and logs it once
    ("Model Runner V2 does not yet support ...; using the V1 model runner instead"), the reason
    naming what V1 costs: the features vLLM's V1 runner refuses (``v1_refused_features``, read from
    the running vLLM); engines with other workers keep V2, and ``VLLM_USE_V2_MODEL_RUNNER=1`` still
    forces V2 (the worker then refuses to start, ``worker.check_config``). A configuration using one
    of those features is then refused by vLLM itself ("Model Runner V1 does not support: ...").
    ``VllmConfig.use_v2_model_runner`` is read in the API process and in every worker alike: all of
    them load this plugin before building a config."""
    from vllm.config import VllmConfig

    from graphchunk.engine.frontend import is_graphchunk_worker

    original = VllmConfig._get_v2_model_runner_unsupported_features
    if getattr(original, "_graphchunk", False):
        return
    reason = v1_reason()

    def unsupported_features(self) -> list[str]:
        found = original(self)
        if is_graphchunk_worker(self.parallel_config.worker_cls):
            found.append(reason)
        return found

    unsupported_features._graphchunk = True
    VllmConfig._get_v2_model_runner_unsupported_features = unsupported_features


def v1_reason() -> str:
    """Why a graphchunk engine runs vLLM's V1 runner, and what that costs, as vLLM's selection log
    line gets it ("Model Runner V2 does not yet support <this>; using the V1 model runner instead")."""
    refused = v1_refused_features()
    cost = (f"; V1 refuses {', '.join(refused)}" if refused
            else "; the features V1 refuses could not be read from this vLLM's source")
    return f"graphchunk's chunk-aware model runner (--worker-cls graphchunk.Runner extends the V1 runner{cost})"


def v1_refused_features() -> tuple[str, ...]:
    """The features vLLM's V1 model runner refuses, read from the running vLLM's own check
    (``VllmConfig._get_v1_model_runner_unsupported_features``: each ``unsupported.append("...")``
    with a literal string, in source order), so that the list follows the installed release; () where
    vLLM has no such check or its source is not installed."""
    import ast
    import inspect
    import textwrap

    from vllm.config import VllmConfig

    method = getattr(VllmConfig, "_get_v1_model_runner_unsupported_features", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    except (OSError, TypeError):
        return ()
    appended = sorted((node.lineno, node.col_offset, node.args[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "append" and len(node.args) == 1
                      and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))
    return tuple(dict.fromkeys(value for _, _, value in appended))


def _guard_request_bodies() -> None:
    """Rejects, for graphchunk engines, JSON booleans among graphchunk's ``vllm_xargs`` and beam
    search on a request whose chunks it would lose (a 400 naming the argument;
    ``request_args.request_body_problem``).

    vLLM's OpenAI request models type ``vllm_xargs`` as ``dict[str, str | int | float |
    list[str | int | float]]``, and pydantic's lax union validation turns true/false into 1/0
    while FastAPI builds the request model, before vLLM or this plugin sees anything:
    ``"graphchunk_boundaries": [true, 5]`` would run as [1, 5], ``"graphchunk_recompute_ratio":
    true`` as 1. The request model cannot be re-validated from here (FastAPI compiled its
    validator when the routes were built), but the raw JSON stays cached on the HTTP request
    (Starlette's ``Request.json()``, which FastAPI used), and completions, chat completions and
    responses all pass it to ``_with_kv_transfer_rejection_cleanup`` before anything reaches the
    engine. The wrapper checks it there, for graphchunk engines only, and turns a problem into
    the same ErrorResponse (400) as vLLM's own request checks, keeping the method's
    KV-connector cleanup for rejected requests."""
    try:
        from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    except ImportError:  # no OpenAI server in this vLLM
        return
    original = GenerateBaseServing._with_kv_transfer_rejection_cleanup
    if getattr(original, "_graphchunk", False):
        return

    async def _with_kv_transfer_rejection_cleanup(self, awaitable, request, raw_request, *args, **kwargs):
        problem = await _request_body_problem(self, raw_request)
        if problem is not None:
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()  # the create_* coroutine never runs: the request does not reach the engine
            awaitable = _returns(self.create_error_response(problem[0], param=problem[1]))
        return await original(self, awaitable, request, raw_request, *args, **kwargs)

    _with_kv_transfer_rejection_cleanup._graphchunk = True
    GenerateBaseServing._with_kv_transfer_rejection_cleanup = _with_kv_transfer_rejection_cleanup


async def _request_body_problem(serving, raw_request) -> tuple[str, str] | None:
    if raw_request is None:
        return None
    serves_graphchunk = getattr(serving, "_graphchunk_engine", None)
    if serves_graphchunk is None:
        from graphchunk.engine.frontend import is_graphchunk_worker

        config = getattr(getattr(serving, "engine_client", None), "vllm_config", None)
        worker_cls = getattr(getattr(config, "parallel_config", None), "worker_cls", None)
        serves_graphchunk = worker_cls is not None and is_graphchunk_worker(worker_cls)
        serving._graphchunk_engine = serves_graphchunk
    if not serves_graphchunk:
        return None
    try:
        body = await raw_request.json()  # cached: FastAPI parsed the body with it
    except Exception:  # not JSON: FastAPI has already answered such requests
        return None
    from graphchunk.engine.request_args import request_body_problem

    return request_body_problem(body)


async def _returns(value):
    return value


def _request_error_class() -> type:
    """A client error for bad graphchunk input. vLLM 0.32's AsyncLLM turns any other exception
    from ``process_inputs`` (plain ValueError included) into EngineGenerateError, an HTTP 500
    with an empty message; VLLMValidationError passes through and becomes a 400 carrying the
    message. It stays a ValueError for ``GraphChunkLLM`` / ``vllm.LLM`` callers."""
    from vllm.exceptions import VLLMValidationError

    class GraphChunkRequestError(VLLMValidationError, ValueError):
        pass

    return GraphChunkRequestError


def _annotator(processor, metrics_file: str | None = None):
    """The request annotator of an engine's ``InputProcessor`` (built once; False for an engine
    whose worker is not graphchunk's). ``metrics_file``: the file this engine's scheduler publishes
    to (``published_pool``); default, the one this process names (an API server's one engine)."""
    annotator = getattr(processor, _ANNOTATOR, None)
    if annotator is None:
        from graphchunk.blend.rope import blend_refusal
        from graphchunk.config import GraphChunkConfig
        from graphchunk.engine.frontend import RequestAnnotator, is_graphchunk_worker, temperature_refusal
        from graphchunk.metrics import engine_metrics_file

        config = processor.vllm_config
        annotator = False
        if is_graphchunk_worker(config.parallel_config.worker_cls):
            settings = GraphChunkConfig.from_additional_config(config.additional_config)
            hf_config = config.model_config.hf_config
            annotator = RequestAnnotator(settings, processor.get_tokenizer(), blend_refusal(config.model_config),
                                         temperature_refusal(hf_config),
                                         published_pool(config, settings, metrics_file or engine_metrics_file(0)))
        setattr(processor, _ANNOTATOR, annotator)
    return annotator or None


def bind_annotator(processor, metrics_file: str) -> None:
    """Builds an engine's annotator now, reading its pool's size from ``metrics_file`` (a program
    may hold several engines, each publishing to its own file: ``GraphChunkLLM``)."""
    _annotator(processor, metrics_file)


def published_pool(vllm_config, settings, path: str | None):
    """``pool_size()`` for the annotator in the API process: the chunk pool's (blocks, block size,
    blend prefix tokens), read from what the engine's scheduler publishes at start-up
    (``pool_blocks_total`` in ``path``, engine 0's metrics file: every data-parallel engine's pool
    has the same size); None until it has, or where nothing is published."""
    from graphchunk.metrics import read_published

    block_size = vllm_config.cache_config.block_size
    found: list[tuple[int, int, int]] = []

    def pool_size() -> tuple[int, int, int] | None:
        if not found and path:
            values = read_published(path)
            if not values or not values.get("pool_blocks_total"):
                return None
            prefix = 0
            if settings.blend_prefix:
                from graphchunk.engine.kv_binding import blend_prefix_tokens

                prefix = len(blend_prefix_tokens(vllm_config.model_config, settings.blend_prefix))
            found.append((int(values["pool_blocks_total"]), block_size, prefix))
        return found[0]

    return pool_size


def _name_metrics_file() -> None:
    """In a main process (the API server, or a program using GraphChunkLLM): name a fresh metrics
    file for the engine to publish its pool to (``published_pool``, ``GraphChunkLLM.stats``).
    vLLM's engine-core and worker processes are multiprocessing children: they inherit the name
    instead. /metrics gets graphchunk's counters through vLLM's connector metrics path
    (``connector_stats.py``), not from this file."""
    import multiprocessing

    from graphchunk import metrics

    if multiprocessing.parent_process() is None:
        metrics.new_metrics_file()
