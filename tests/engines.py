"""The test modules' engines, started ahead of the tests that use them and closed behind them.

Starting an engine is mostly vLLM's import in each process it spawns (engine core, worker: 10-15 s
of one core each; vLLM spawns them on CPU), closing one mostly waiting (vLLM gives an engine core
5 s to exit). Neither keeps both cores busy, so the session overlaps them with other tests:

* ``fixture(build, name)`` makes the engine fixture ``name`` (module scope, or session scope in
  conftest) of a zero-argument ``build``. Before each test, when fewer than ``MAX_IN_FLIGHT`` starts
  are in flight and fewer than ``MAX_WAITING`` engines wait for their module, the session starts the
  next engine a later module needs, in a thread of its own, and waits until that thread has spawned
  the build's first process (``start_next``; the thread's own children, so another start's
  processes never count): that process inherits the environment of that moment, before any fixture
  of the test ran (``GraphChunkLLM`` passes its metrics file to its engine that way, a new one for
  each), plus the build's own ``environment`` (test_tensor_parallel's thread binding), set only
  until that process spawned and only while no other start is in flight: no test and no other
  build's process sees it. A start that ends inside a long module lets the next begin at its next
  test. The fixture takes what that start built (its exception raised there) or builds the engine
  then (a module run alone, ``-k``), and closes it in a thread of its own (``close_soon``).
* An engine is a ``GraphChunkLLM`` (closed by ``shutdown``) or a server (``stop``); a build may also
  run console scripts to their end (``run_ahead``: a precompute, a warm-up; their results need no
  closing) or launch a run's servers without waiting for them (``Ahead``: a soak's).
  ``scratch(name)`` gives a build a new directory (a tier's, a connector's storage).
* ``finish()``, the session's last teardown: closes what was started and never taken, joins every
  close and removes the scratch directories, raising the first failure.

So at most ``MAX_WAITING`` + 2 builds' engines are alive: the running module's, those waiting and
one closing (the pressure soak's ``Ahead`` holds a server per mode).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import pytest

from perf.common.server import poll

SPAWN_DEADLINE_S = 120.0
RUN_AHEAD_TIMEOUT_S = 900.0
"""A console script a build runs to its end (``run_ahead``) is killed after this, failing the build."""
MAX_IN_FLIGHT = 1
"""Starts running at once (each spawns its first process before the next test begins). Two measured
slower over the whole suite (1790 s against 1743 s, one run each, the same session): beside the
first modules' benchmarks two starts slowed both, and ``MAX_WAITING`` still stopped the third."""
MAX_WAITING = 3
"""Engines started and not yet taken. Over the whole suite two measured faster than one, and three
than two (1713 s against 1822 s, one run each; the least memory available 10 of 24 GB)."""

_builds: dict[tuple[str, str], object] = {}
"""(defining module, fixture name) -> ``build``; "conftest" fixtures serve every module."""
_environments: dict[object, dict[str, str]] = {}
"""``build`` -> the variables its processes need beyond this process's environment."""
_started: dict[object, Future] = {}
_taken: set = set()
_closing: list[Future] = []
_modules_begun: set[str] = set()
_scratch: list[Path] = []
_start = threading.local()
"""In a build's thread, ``environment``: this process's environment when ``start_next`` began it."""


def fixture(build, name: str, scope: str = "module", environment: dict[str, str] | None = None):
    _builds[(build.__module__, name)] = build
    _environments[build] = dict(environment or {})

    @pytest.fixture(scope=scope, name=name)
    def engine():
        built = take(build)
        yield built
        close_soon(built)

    return engine


def take(build):
    """What the start of ``build`` built (its exception raised here), or a new one."""
    future = _started.pop(build, None)
    _taken.add(build)
    if future is not None:
        return future.result()
    with _variables(_environments.get(build, {})):
        return build()


def close_soon(engine) -> None:
    close = getattr(engine, "shutdown", None) or getattr(engine, "stop", None)
    if close is not None:  # a command's result (``run_ahead``) has nothing to close
        _closing.append(_in_thread(close, f"close {type(engine).__name__}"))


class Ahead(NamedTuple):
    """A run a build prepared and the servers it launched for it, not waited for (a soak's): closing
    stops them, which a run that stopped them already leaves unchanged (``VllmServer.stop``)."""
    run: object
    servers: tuple

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def run_ahead(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m module argv`` to its end, its output captured, as a build runs a console script.
    In a build started ahead it runs in the environment of the build's start, also when it begins
    after the build's first process, while a later module's test may have changed this process's."""
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          env=getattr(_start, "environment", None), timeout=RUN_AHEAD_TIMEOUT_S)


def scratch(name: str) -> Path:
    _scratch.append(Path(tempfile.mkdtemp(prefix=f"graphchunk-{name}-")))
    return _scratch[-1]


def start_next(item) -> None:
    """Before each test: starts the next engine a later module needs, unless ``MAX_IN_FLIGHT``
    starts are in flight or ``MAX_WAITING`` engines wait."""
    _modules_begun.add(item.module.__name__)
    in_flight = sum(not future.done() for future in _started.values())
    if len(_started) >= MAX_WAITING or in_flight >= MAX_IN_FLIGHT:
        return
    build = _next_build(item)
    own = _environments.get(build, {})
    if build is None or (own and in_flight):
        return
    environment = {**os.environ, **own}  # before any fixture of the test ran
    spawner: list[int] = []

    def start():
        _start.environment = environment
        spawner.append(threading.get_native_id())
        return build()

    with _variables(own):
        future = _in_thread(start, f"start {build.__module__}.{build.__name__}")
        _started[build] = future
        poll(lambda: future.done() or _has_children(spawner), SPAWN_DEADLINE_S, interval=0.05)


def finish() -> None:
    for future in _started.values():
        if future.exception() is None:  # a start no test took: its failure concerns no test
            close_soon(future.result())
    _started.clear()
    errors = [future.exception() for future in _closing if future.exception() is not None]
    _closing.clear()
    while _scratch:
        shutil.rmtree(_scratch.pop(), ignore_errors=True)
    if errors:
        raise errors[0]


def _next_build(item):
    """The first build a test of a later module needs that was neither started nor taken nor is
    needed by this module (its fixture builds it now), or None."""
    module = item.module.__name__
    needs = _needs_in_order(item.session.items)
    now = {build for other, build in needs if other == module}
    for other, build in needs:
        if other not in _modules_begun and build not in _started and build not in _taken and build not in now:
            return build
    return None


_order: tuple = (None, ())
"""(the session's items, ``_needs_in_order`` of them): computed once, not before every test."""


def _needs_in_order(items) -> tuple:
    """(module, build) for every build a test needs, once per module, in the tests' order."""
    global _order
    if _order[0] is not items:
        _order = (items, tuple(dict.fromkeys((item.module.__name__, build) for item in items
                                             for build in _needs(item))))
    return _order[1]


def _needs(item) -> list:
    return [build for (module, name), build in _builds.items()
            if name in item.fixturenames and module in ("conftest", item.module.__name__)]


@contextlib.contextmanager
def _variables(variables: dict[str, str]):
    """``variables`` set in this process's environment, then put back as they were, one by one: not
    ``mock.patch.dict(os.environ)``, which clears and refills the whole environment while build
    threads may be spawning (a child forked then could start with none)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _has_children(spawner: list[int]) -> bool:
    """Whether the thread ``spawner`` holds the native id of has a child process that has begun its
    own program (Linux keeps each thread's children apart: ``/proc/PID/task/TID/children``). Until
    its exec a child (``subprocess`` forks with vfork) shares this process's memory, environment
    included, and its command line is still this process's."""
    try:
        children = Path(f"/proc/{os.getpid()}/task/{spawner[0]}/children").read_text().split() if spawner else ()
        return any(Path(f"/proc/{pid}/cmdline").read_bytes() != _OWN_COMMAND_LINE for pid in children)
    except (FileNotFoundError, ProcessLookupError):  # the thread or the child has ended
        return False


_OWN_COMMAND_LINE = Path("/proc/self/cmdline").read_bytes()


def _in_thread(fn, name: str) -> Future:
    future: Future = Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name).start()
    return future
