"""Replicas behind vLLM's router: graphchunk servers sharing one persistent tier, ``vllm-router``
in front (the Rust router vLLM publishes on the package index, ``pip install vllm-router``).

    with Replicas(model, n=2, graphchunk={...}, tier=dir, policy="round_robin") as fleet:
        fleet.router.url                 # send requests here
        fleet.servers[i].metrics()       # each replica's own counters

What the router does with each policy (read in vllm-router 0.1.17's source and measured; see
docs/replicas.md): ``round_robin`` alternates; ``cache_aware`` asks every replica's
``/v1/chat/completions/render`` for the request's token ids (graphchunk's render places the
documents there) and keeps an approximate prefix tree per replica; ``kv_aware`` matches the same
token ids against a prefix tree built from each replica's KV events (``--kv-events-config``; it
hashes the events' ``token_ids`` itself and anchors chains at the prompt's first token), which it
subscribes to per replica (``--kv-event-source URL=ENDPOINT``); ``consistent_hash`` hashes a
session header (``x-session-id``, ``x-user-id``, ...) and sends every request without one to the
same replica.

The router listens on loopback; it starts once every replica answers ``/health``. Each replica
publishes its KV events on a loopback port of its own: vLLM's publisher binds an endpoint only if
it names a wildcard or an IPv6 address (``tcp://[::ffff:127.0.0.1]:P`` binds 127.0.0.1:P, nothing
else) and the router takes ``tcp://HOST:PORT`` endpoints only.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from graphchunk.tools.serve_demo import VllmServer, free_port, wait_for_health

ROUTER_POLICIES = ("round_robin", "cache_aware", "kv_aware", "consistent_hash")


def router_program() -> str | None:
    """The ``vllm-router`` executable beside this Python, or on PATH (None: not installed)."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.is_file() else shutil.which("vllm-router")


def kv_events_flags(endpoint: str) -> list[str]:
    """``vllm serve`` flags publishing the server's KV events on ``endpoint`` (bound by vLLM)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}
    return ["--kv-events-config", json.dumps(config)]


class Router:
    """``vllm-router`` over ``worker_urls`` with ``policy``, as a child process on loopback."""

    def __init__(self, worker_urls: list[str], policy: str, *, block_size: int | None = None,
                 event_sources: dict[str, str] | None = None, model: str | None = None,
                 log_path: Path | None = None):
        program = router_program()
        if program is None:
            raise FileNotFoundError("vllm-router is not installed (pip install vllm-router)")
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        """The router's own Prometheus endpoint (``/metrics``): its routing decisions."""
        self.args = [program, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                     "--worker-startup-check-interval", "1", "--log-level", "info",
                     "--worker-urls", *worker_urls]
        for url, endpoint in (event_sources or {}).items():
            self.args += ["--kv-event-source", f"{url}={endpoint}"]
        if event_sources:  # kv_aware's static sources: the replicas' block size and served model name
            self.args += ["--kv-event-block-size", str(block_size), "--kv-event-model", str(model)]
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-router-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def start(self) -> "Router":
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Seconds until the router answers (it listens once every replica is healthy)."""
        return wait_for_health(self, "vllm-router", timeout, interval=0.5)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Replicas:
    """``n`` graphchunk servers on one tier directory, started together, and a router over them.
    ``flags`` are every server's ``vllm serve`` flags (``--block-size`` among them: ``block_size``
    tells ``kv_aware`` the same)."""

    def __init__(self, model: str | Path, *, n: int = 2, dtype: str = "float32", graphchunk: dict,
                 tier: Path, flags: list[str], policy: str = "round_robin", block_size: int,
                 log_dir: Path, worker_cls: str | None = "graphchunk.Runner"):
        self.policy = policy
        ports = [free_port() for _ in range(n)] if policy == "kv_aware" else []
        settings = {**graphchunk, "store_path": str(tier)} if worker_cls else None
        # --enable-scale-out: vLLM's /v1/chat/completions/render, where cache_aware and kv_aware get a
        # request's token ids (graphchunk places the documents there); without it vLLM 0.32 answers 403
        # and the router routes those requests by load alone.
        scale_out = ["--enable-scale-out"] if policy in ("cache_aware", "kv_aware") else []
        self.servers = [VllmServer(model, dtype=dtype, graphchunk=settings, worker_cls=worker_cls,
                                   flags=[*flags, *scale_out, *(kv_events_flags(f"tcp://[::ffff:127.0.0.1]:{ports[i]}")
                                                    if ports else [])],
                                   log_path=log_dir / f"replica-{i}.log") for i in range(n)]
        urls = [server.url for server in self.servers]
        sources = {url: f"tcp://127.0.0.1:{port}" for url, port in zip(urls, ports)} or None
        self.router = Router(urls, policy, block_size=block_size, event_sources=sources, model=str(model),
                             log_path=log_dir / f"router-{policy}.log")

    def start(self, timeout: float = 900.0, progress=None) -> "Replicas":
        for server in self.servers:
            server.start()
        try:
            for server in self.servers:
                server.wait_healthy(timeout, progress)
            self.router.start().wait_ready()
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.router.stop()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> "Replicas":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
