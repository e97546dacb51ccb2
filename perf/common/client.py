"""The soaks' clients (``perf/soak``): a raw-socket HTTP client with its abort kinds, and the
dispatcher.

* ``Client.run(item, incarnation)`` sends one trace item to ``/v1/completions`` and returns an
  ``Outcome`` (never raises): ``complete`` reads the whole answer; ``abort_stream`` disconnects
  after the first streamed token event, ``abort_prefill`` after the headers and before a token
  event, ``abort_nostream`` before any response byte (a client that goes away: FIN both ways);
  an answer that came before the planned disconnect is ``late``;
* ``Estimates``: rolling medians of latency and time to first token that time those aborts;
* ``Dispatcher``: hands items to client threads in trace order and pauses, drained, at barrier
  indices until the main thread calls ``resume``;
* ``client_threads()``: started threads that each run one ``Client`` over the dispatcher.
"""
from __future__ import annotations

import http.client
import json
import select
import socket
import statistics
import threading
import time
from dataclasses import dataclass

from perf.common.trace import Encoder, Item


@dataclass
class Outcome:
    item: Item
    status: str
    """ok | aborted | late (an abort planned, the answer came first) | error"""
    kind: str = ""
    """aborted: abort_stream, abort_prefill or abort_nostream (what happened, not what was planned)"""
    incarnation: int = 0
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None
    completion_tokens: int = 0
    error: str = ""


def _raw_open(host: str, port: int, body: dict, timeout: float) -> socket.socket:
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.sendall(head + data)
    return sock


def _disconnect(sock: socket.socket) -> None:
    """Closes like a client that goes away: FIN in both directions at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _read_headers(sock: socket.socket) -> tuple[int, bytes]:
    """(status, bytes received after the headers)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before the response headers ({buf[:200]!r})")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), rest


def count_statuses(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return counts


class Estimates:
    """Rolling medians of completed requests' latency and streamed requests' time to first token,
    which set how long abort_prefill / abort_nostream clients wait before they disconnect."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latency: list[float] = []
        self.ttft: list[float] = []

    def add(self, name: str, value: float) -> None:
        with self.lock:
            values = getattr(self, name)
            values.append(value)
            del values[:-64]

    def get(self, name: str, default: float) -> float:
        with self.lock:
            values = getattr(self, name)
            return statistics.median(values) if values else default


class Client:
    """One client thread's connection and the request kinds."""

    def __init__(self, host: str, port: int, encoder: Encoder, estimates: Estimates, timeout: float):
        self.host, self.port = host, port
        self.encoder = encoder
        self.estimates = estimates
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def run(self, item: Item, incarnation: int) -> Outcome:
        out = Outcome(item, "error", incarnation=incarnation, start=time.monotonic())
        try:
            getattr(self, item.action)(item, out)
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome
            out.status, out.error = "error", f"{type(exc).__name__}: {exc}"
            self.close()
        out.end = time.monotonic()
        return out

    def complete(self, item: Item, out: Outcome) -> None:
        body = self.post(item, out)
        if body is None:
            return
        choice = body["choices"][0]
        out.prompt_ids, out.token_ids = choice.get("prompt_token_ids"), choice.get("token_ids")
        out.completion_tokens = body.get("usage", {}).get("completion_tokens", len(out.token_ids or ()))
        out.status = "ok"
        self.estimates.add("latency", time.monotonic() - out.start)
        self.close()

    def post(self, item: Item, out: Outcome) -> dict | None:
        """The completed (not streamed) answer's body, or None with ``out.error`` set."""
        # A connection per request: a kept-alive one would go stale across the restart (and
        # uvicorn closes idle ones after 5 s while the clients wait at the restart barrier).
        self.close()
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        self.conn.request("POST", "/v1/completions", json.dumps(self.encoder.body(item, stream=False)),
                          {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {raw[:300]!r}"
            return None
        return json.loads(raw)

    def _streamed(self, item: Item, out: Outcome, wait_before_first_token: float | None) -> None:
        """Streams; disconnects after the first token event, or (``wait_before_first_token`` set)
        after the headers plus that many seconds if no token event came by then."""
        sock = _raw_open(self.host, self.port, self.encoder.body(item, stream=True), self.timeout)
        try:
            status, rest = _read_headers(sock)
            if status != 200:
                out.error = f"HTTP {status}: {rest[:300]!r}"
                return
            if wait_before_first_token is not None and b"data: " not in rest:
                readable, _, _ = select.select([sock], [], [], wait_before_first_token)
                if not readable:
                    out.status, out.kind = "aborted", "abort_prefill"
                    return
            while b"data: " not in rest:
                chunk = sock.recv(65536)
                if not chunk:
                    out.error = "stream closed before the first token"
                    return
                rest += chunk
            out.ttft = time.monotonic() - out.start
            self.estimates.add("ttft", out.ttft)
            out.status, out.kind = ("late", "") if b"data: [DONE]" in rest else ("aborted", "abort_stream")
        finally:
            _disconnect(sock)

    def abort_stream(self, item: Item, out: Outcome) -> None:
        self._streamed(item, out, None)

    def abort_prefill(self, item: Item, out: Outcome) -> None:
        ttft = self.estimates.get("ttft", 0.5 * self.estimates.get("latency", 1.0))
        self._streamed(item, out, item.delay ** 2 * ttft)  # squared: most of them early

    def abort_nostream(self, item: Item, out: Outcome) -> None:
        wait = item.delay * self.estimates.get("latency", 1.0)
        sock = _raw_open(self.host, self.port, self.encoder.body(item, stream=False), self.timeout)
        try:
            readable, _, _ = select.select([sock], [], [], wait)
            if readable:  # the answer (or an error) is arriving: too late to abort
                status, _ = _read_headers(sock)
                out.status = "late" if status == 200 else "error"
                out.error = "" if status == 200 else f"HTTP {status}"
            else:
                out.status, out.kind = "aborted", "abort_nostream"
        finally:
            _disconnect(sock)


class Dispatcher:
    """Hands trace items to the client threads in order. At a barrier index it stops handing out,
    lets the in-flight requests finish and tells the main thread (which runs the fault and calls
    ``resume``)."""

    def __init__(self, items: list[Item], barriers: list[int]):
        self.items = items
        self.barriers = sorted(b for b in barriers if 0 < b < len(items))
        self.cond = threading.Condition()
        self.next = 0
        self.in_flight = 0
        self.done_count = 0
        self.paused = False
        self.stopped = False
        self.outcomes: list[Outcome] = []

    def take(self) -> Item | None:
        with self.cond:
            while True:
                if self.stopped or self.next >= len(self.items):
                    return None
                if self.barriers and self.next == self.barriers[0] and not self.paused:
                    self.barriers.pop(0)
                    self.paused = True
                    self.cond.notify_all()
                if self.paused:
                    self.cond.wait()
                    continue
                item = self.items[self.next]
                self.next += 1
                self.in_flight += 1
                return item

    def finish(self, outcome: Outcome) -> None:
        with self.cond:
            self.in_flight -= 1
            self.done_count += 1
            self.outcomes.append(outcome)
            self.cond.notify_all()

    def wait(self, timeout: float) -> str | None:
        """'barrier' (paused and drained), 'finished', or None after ``timeout``."""
        with self.cond:
            def state():
                if self.paused and self.in_flight == 0:
                    return "barrier"
                if self.in_flight == 0 and (self.stopped or self.next >= len(self.items)):
                    return "finished"
                return None
            self.cond.wait_for(state, timeout)
            return state()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.paused = False
            self.cond.notify_all()


def client_threads(dispatcher: Dispatcher, count: int, new_client, incarnation) -> list[threading.Thread]:
    """``count`` started daemon threads, each with its own ``new_client()``, that send the
    dispatcher's items until it has none (``incarnation()`` labels each outcome)."""
    def loop():
        client = new_client()
        try:
            while (item := dispatcher.take()) is not None:
                outcome = Outcome(item, "error", error="client crashed")
                try:
                    outcome = client.run(item, incarnation())
                finally:
                    dispatcher.finish(outcome)
        finally:
            client.close()

    threads = [threading.Thread(target=loop, name=f"soak-client-{i}", daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads
