"""The server side of the soaks and the serving benches: starting ``vllm serve``, and what is read
or done on its side.

* ``Servers``: the run's servers, one at a time (``current``, numbered by ``incarnation``):
  ``start`` (graphchunk's worker with the soak's settings and a tier directory, or vanilla vLLM
  with ``worker_cls=None``) waits until healthy; ``metrics``, ``drain``, ``read_leaks`` and
  ``health`` read the current one over HTTP; ``end_incarnation`` records its drained /metrics,
  leak gauges and final RSS; a sampler thread records its process tree's RSS;
* ``scrape`` / ``total``: Prometheus text of /metrics as samples; ``GaugeSampler`` reads gauges on a
  thread while a pass runs, ``spread`` summarizes them, ``label_of`` reads an info gauge's field;
* ``tree_rss``: RSS of a process and its descendants (psutil, else /proc);
* tier files: ``tier_files`` lists them, ``truncate_file`` and ``flip_payload_bytes`` plant
  corruption in place, ``read_or_none`` reads one back;
* ``poll``: a condition's first truthy value within a deadline.

Imports ``graphchunk`` (installed, or the repository on ``sys.path``: ``harness.script_env``).
"""
from __future__ import annotations

import os
import random
import shlex
import threading
import time
from pathlib import Path

from graphchunk.metrics import PROMETHEUS_PREFIX
from graphchunk.tools.serve_demo import SERVER_FLAGS, VllmServer

TIER_SUFFIX = ".gckv"
LEAK_GAUGES = ("vllm:graphchunk_pool_refs_held", "vllm:graphchunk_pool_blocks_leaked")
KV_USAGE = "vllm:kv_cache_usage_perc"
"""vLLM's KV-cache usage: 0 once every request has given its blocks back (cached blocks count as free)."""
TIER_COUNTERS = ("vllm:graphchunk_tier_hits_total", "vllm:graphchunk_tier_writes_total", "vllm:graphchunk_tier_rejected_total")
COUNTERS = ("vllm:graphchunk_lookups_total", "vllm:graphchunk_hits_total", "vllm:graphchunk_misses_total",
            "vllm:graphchunk_evictions_total", "vllm:graphchunk_tokens_reused_total", "vllm:graphchunk_tokens_computed_total",
            *TIER_COUNTERS, "vllm:graphchunk_tier_loads_total", "vllm:graphchunk_tier_evictions_total",
            "vllm:graphchunk_tier_write_errors_total")


def scrape(url: str, timeout: float = 30.0) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of /metrics as (name, labels, value)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, labels = head, {}
        if "{" in head:
            name, _, rest = head.partition("{")
            for part in rest.rstrip("}").split(","):
                if "=" in part:
                    k, _, v = part.partition("=")
                    labels[k.strip()] = v.strip().strip('"')
        try:
            samples.append((name, labels, float(value)))
        except ValueError:
            continue
    return samples


def total(samples, name: str, **labels) -> float | None:
    """Sum of ``name``'s samples whose labels include ``labels``; None when it has none."""
    found = [v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items())]
    return sum(found) if found else None


class GaugeSampler:
    """Samples /metrics gauges on a background thread while a pass runs: ``with
    GaugeSampler(url, names):`` reads ``names`` (each summed over its labels) at entry and then every
    ``interval`` seconds until exit; ``samples`` holds one dict per read (a name the server does not
    export is absent; a read that failed is skipped). One /metrics read per interval."""

    def __init__(self, url: str, names: tuple[str, ...], interval: float = 0.5):
        self.url, self.names, self.interval = url, names, interval
        self.samples: list[dict[str, float]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GaugeSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()

    def _run(self) -> None:
        while True:
            try:
                samples = scrape(self.url, timeout=5.0)
            except OSError:
                samples = None
            if samples is not None:
                self.samples.append({name: value for name in self.names if (value := total(samples, name)) is not None})
            if self.stopped.wait(self.interval):
                return


def spread(values: list[float]) -> dict | None:
    """``{"median", "max", "samples"}`` of sampled values; None without any."""
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {"median": median, "max": ordered[-1], "samples": len(ordered)}


def label_of(samples, name: str, label: str) -> str | None:
    """Label ``label`` of the first sample of ``name`` (an info gauge's field), or None."""
    return next((ls.get(label) for n, ls, _ in samples if n == name and label in ls), None)


def tree_rss(pid: int) -> int:
    """RSS of a process and all its descendants (bytes; shared pages counted once per process)."""
    try:
        import psutil

        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        rss = 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
            except psutil.Error:
                pass
        return rss
    except ImportError:
        return _proc_tree_rss(pid)
    except Exception:  # noqa: BLE001 - the process went away
        return 0


def _proc_tree_rss(pid: int) -> int:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    rss, todo, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            rss += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
        todo += children.get(p, [])
    return rss


def tier_files(root: Path | None) -> dict[Path, int]:
    """Tier files (any depth) and their sizes."""
    if root is None or not root.exists():
        return {}
    found = {}
    for path in root.rglob("*" + TIER_SUFFIX):
        try:
            found[path] = path.stat().st_size
        except OSError:
            pass
    return found


def flip_payload_bytes(path: Path, rng: random.Random, count: int = 16) -> list[int]:
    """Inverts ``count`` bytes in the file's second half (past the header: the payload)."""
    data = bytearray(path.read_bytes())
    offsets = sorted(rng.sample(range(len(data) // 2, len(data)), min(count, len(data) - len(data) // 2)))
    for offset in offsets:
        data[offset] ^= 0xFF
    with open(path, "r+b") as f:  # in place, as a bad disk or a stray writer would
        f.write(data)
    return offsets


def truncate_file(path: Path) -> int:
    size = path.stat().st_size // 2
    os.truncate(path, size)
    return size


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def delta(after: dict, before: dict, name: str) -> float:
    """How much the /metrics sample ``name`` grew between two ``Servers.metrics()`` reads."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def poll(condition, timeout: float, interval: float = 0.2):
    """``condition()``'s first truthy value within ``timeout`` seconds, else its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


# --- servers ------------------------------------------------------------------------------------

def server_flags(args) -> list[str]:
    """``vllm serve`` flags of every server of the run (graphchunk's and vanilla)."""
    a = args
    return [*SERVER_FLAGS[:1], "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(a.kv_cache_bytes),
            "--max-model-len", str(a.max_model_len), "--block-size", str(a.block_size),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--max-num-seqs", str(a.max_num_seqs or 2 * max(a.concurrency, a.throughput_concurrency or 0)),
            "--enable-prefix-caching", "--disable-uvicorn-access-log", "--seed", str(a.seed)]


def graphchunk_settings(args, pool_tokens: int, max_chunk_len: int, store_root: Path) -> dict:
    """graphchunk's ``--additional-config`` section."""
    gc = {"pool_tokens": pool_tokens, "max_chunks": max(32, args.docs_per_request[1]),
          "max_chunk_len": max_chunk_len, "store_path": str(store_root), "mode": "isolated",
          "separator": "##"}  # completions traces send the seeds' form (``trace.Encoder.text``)
    if args.store_bytes:
        gc["store_bytes"] = args.store_bytes
    if args.eviction:
        gc["eviction"] = args.eviction
    return gc


class Servers:
    """The run's servers, one at a time, and the numbers read from each."""

    def __init__(self, model_path: Path, args, pool_tokens: int, max_chunk_len: int, log_dir: Path, log=print):
        self.model_path = model_path
        self.args = args
        self.pool_tokens, self.max_chunk_len = pool_tokens, max_chunk_len
        self.log_dir = log_dir
        self.log = log
        self.current: VllmServer | None = None
        self.incarnation: int | str = 0
        self.logs: list[str] = []
        self.rss: list[tuple[float, int, int]] = []  # (seconds since start, incarnation, bytes)
        self.rss_baseline: dict[int, int] = {}
        self.rss_final: dict[int, int] = {}
        self.incarnation_metrics: list[dict] = []
        self.leaks: list[dict] = []
        self.t0 = time.monotonic()
        self.sampling = threading.Event()

    def start(self, name: str, worker_cls: str | None, store_root: Path | None, port: int,
              log_requests: bool = False, settings: dict | None = None, env: dict | None = None) -> VllmServer:
        """Starts ``current`` and waits until it is healthy (``launch``, then ``adopt``)."""
        return self.adopt(name, self.launch(name, worker_cls, store_root, port, log_requests, settings, env))

    def launch(self, name: str, worker_cls: str | None, store_root: Path | None, port: int,
               log_requests: bool = False, settings: dict | None = None, env: dict | None = None) -> VllmServer:
        """Starts a server's processes without waiting for them, so that several start at once;
        ``settings``: graphchunk's, instead of the soak's (``graphchunk_settings``); ``env``: added
        to the server's environment."""
        log_path = self.log_dir / f"{name}.log"
        # Soak servers log "Added request X." / "Request X aborted." (AsyncLLM), which counts the
        # disconnects the engine saw; throughput servers log nothing per request.
        flags = server_flags(self.args)
        if log_requests:
            flags += ["--enable-log-requests", "--max-log-len", "0"]
        if settings is None:
            settings = graphchunk_settings(self.args, self.pool_tokens, self.max_chunk_len, store_root)
        server = VllmServer(self.model_path, dtype=self.args.dtype, port=port, log_path=log_path,
                            graphchunk=settings if worker_cls else None, flags=flags, worker_cls=worker_cls,
                            env=env)
        self.logs.append(str(log_path))
        self.log(f"[soak] starting {name}: vllm {shlex.join(server.args)}")
        return server.start()

    def adopt(self, name: str, server: VllmServer) -> VllmServer:
        """Waits until a launched server is healthy (stopping it if it is not) and makes it ``current``."""
        try:
            took = server.wait_healthy(self.args.startup_timeout)
        except Exception:
            server.stop()
            raise
        self.log(f"[soak] {name} healthy, waited {took:.0f} s (log {server.log_path})")
        self.current = server
        return server

    def stop(self) -> int | None:
        """Stops ``current`` (SIGTERM); its exit code."""
        server, self.current = self.current, None
        return server.stop()

    def died(self) -> bool:
        return self.current is not None and self.current.process.poll() is not None

    def metrics(self) -> dict[str, float]:
        """graphchunk's samples and the vLLM ones this run reads, by name (labels summed). An
        unreadable /metrics raises with the server's state and its log's last lines."""
        try:
            samples = scrape(self.current.url)
        except OSError as exc:
            server, code = self.current, self.current.process.poll()
            lines = Path(server.log_path).read_text(errors="replace").splitlines()[-40:]
            state = f"exited with {code}" if code is not None else "running"
            raise RuntimeError(f"/metrics of {server.url} unreadable ({exc}); the server {state}; "
                               f"the end of {server.log_path}:\n" + "\n".join(lines)) from exc
        found: dict[str, float] = {}
        for name, _, value in samples:  # every engine's series summed; prometheus_client's _created stamps left out
            if name.startswith(PROMETHEUS_PREFIX) and not name.endswith("_created"):
                found[name] = found.get(name, 0.0) + value
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", KV_USAGE):
            value = total(samples, name)
            if value is not None:
                found[name] = value
        for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_preemptions_total"):
            found[name] = total(samples, name) or 0.0
        for reason in ("stop", "length", "abort", "error"):
            found[f"vllm_finished_{reason}"] = total(samples, "vllm:request_success_total", finished_reason=reason) or 0.0
        return found

    def drain(self, timeout: float = 300.0) -> bool:
        """Waits until the engine has no running or waiting request."""
        def idle():
            m = self.metrics()
            return m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
        return bool(poll(idle, timeout))

    def read_leaks(self) -> dict:
        """The pool accounting gauges and vLLM's KV-cache usage once they read 0 (a step may still be
        publishing, a cancelled request's blocks come back once its load is reported), or their
        values at the deadline (None: not exported)."""
        def read():
            m = self.metrics()
            return {name: m.get(name) for name in (*LEAK_GAUGES, KV_USAGE)}

        def clean():
            values = read()
            return values if all(v == 0 for v in values.values()) else None

        values = poll(clean, 30.0) or read()
        return {"incarnation": self.incarnation, **values}

    def health(self) -> int | str:
        """``/health``'s status code, or the error."""
        import urllib.request

        try:
            with urllib.request.urlopen(self.current.url + "/health", timeout=30) as resp:
                return resp.status
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"

    def sample_rss(self) -> int:
        server = self.current
        rss = tree_rss(server.process.pid) if server and server.process else 0
        self.rss.append((round(time.monotonic() - self.t0, 1), self.incarnation, rss))
        return rss

    def mark_rss_baseline(self) -> None:
        self.rss_baseline[self.incarnation] = self.sample_rss()

    def start_sampler(self) -> None:
        """Samples the RSS every ``--rss-interval`` seconds until ``stop_sampler``."""
        def sample():
            while not self.sampling.wait(self.args.rss_interval):
                if self.current is not None:
                    self.sample_rss()
        threading.Thread(target=sample, daemon=True).start()

    def stop_sampler(self) -> None:
        self.sampling.set()

    def end_incarnation(self) -> None:
        """Drain, leak gauges, counters and final RSS of the current server."""
        if not self.drain():
            self.log("[soak] the engine did not drain within 300 s")
        self.leaks.append(self.read_leaks())
        self.incarnation_metrics.append(self.metrics())
        self.rss_final[self.incarnation] = self.sample_rss()
