"""``tests/engines.py``: which engine the session starts ahead, when, and that every engine is built
once and closed. Fake modules, tests and engines; each build spawns a real short-lived process (the
start waits for one)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

import engines
from perf.common.server import poll


class FakeEngine:
    def __init__(self, name: str, process: subprocess.Popen, fail_close: bool = False):
        self.name, self.process, self.fail_close, self.closed = name, process, fail_close, threading.Event()

    def shutdown(self):
        self.process.kill()
        self.process.wait()
        self.closed.set()
        if self.fail_close:
            raise RuntimeError(f"{self.name} did not close")


class Builds:
    """Zero-argument builds that count their calls and spawn a process living until the engine
    closes, as an engine's start does."""

    def __init__(self):
        self.calls: list[str] = []

    def make(self, name: str, module: str, fail: bool = False, fail_close: bool = False,
             hold: threading.Event | None = None):
        """``hold``: the build returns only once it is set (a start in flight until then)."""
        def build():
            self.calls.append(name)
            process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            if hold is not None:
                assert hold.wait(60)
            if fail:
                process.kill()
                process.wait()
                raise RuntimeError(f"{name} did not start")
            return FakeEngine(name, process, fail_close)
        build.__module__, build.__name__ = module, f"build_{name}"
        return build


@pytest.fixture
def fresh(monkeypatch):
    """The registry emptied for the test (the session's own is put back afterwards)."""
    for attr, value in (("_builds", {}), ("_started", {}), ("_taken", set()), ("_closing", []),
                        ("_modules_begun", set()), ("_scratch", []), ("_order", (None, ())),
                        ("_environments", {})):
        monkeypatch.setattr(engines, attr, value)
    return Builds()


def session(*modules: tuple[str, list[str]]):
    """Items of modules in order: (module name, the fixtures each of its two tests uses)."""
    items = []
    ns = SimpleNamespace(items=items)
    for name, fixtures in modules:
        module = SimpleNamespace(__name__=name)
        items += [SimpleNamespace(module=module, fixturenames=fixtures, session=ns) for _ in range(2)]
    return items


def test_later_modules_engines_start_in_order_before_tests_each_built_once(fresh, monkeypatch):
    monkeypatch.setattr(engines, "MAX_WAITING", 2)
    builds = {name: fresh.make(name, f"test_{name}") for name in "bcd"}
    for name, build in builds.items():
        engines.fixture(build, f"{name}_llm")
    items = session(("test_a", []), ("test_between", []), *((f"test_{n}", [f"{n}_llm"]) for n in "bcd"))

    def begin(index):
        engines.start_next(items[index])
        for future in list(engines._started.values()):
            future.result()  # done: none in flight for the next step

    begin(0)
    assert fresh.calls == ["b"]
    begin(1)  # b's start ended: the module's next test starts c
    assert fresh.calls == ["b", "c"]
    begin(2)
    begin(4)  # b and c wait: MAX_WAITING
    assert fresh.calls == ["b", "c"]
    taken = [engines.take(builds["b"])]
    begin(6)
    assert fresh.calls == ["b", "c", "d"]
    taken += [engines.take(builds["c"]), engines.take(builds["d"])]
    assert [engine.name for engine in taken] == ["b", "c", "d"] and fresh.calls == ["b", "c", "d"]
    for engine in taken:
        engines.close_soon(engine)
    engines.finish()
    assert all(engine.closed.is_set() for engine in taken)


def test_two_starts_run_at_once_and_a_build_with_its_own_environment_starts_alone(fresh, monkeypatch):
    monkeypatch.setattr(engines, "MAX_WAITING", 5)
    monkeypatch.setattr(engines, "MAX_IN_FLIGHT", 2)
    holds = {name: threading.Event() for name in "bcd"}
    builds = {name: fresh.make(name, f"test_{name}", hold=holds[name]) for name in "bcd"}
    for name in "bc":
        engines.fixture(builds[name], f"{name}_llm")
    engines.fixture(builds["d"], "d_llm", environment={"GRAPHCHUNK_TEST_OWN": "d"})
    items = session(("test_a", []), *((f"test_{n}", [f"{n}_llm"]) for n in "bcd"))
    engines.start_next(items[0])
    engines.start_next(items[1])  # b in flight: c starts beside it
    assert fresh.calls == ["b", "c"]
    engines.start_next(items[1])  # two in flight: MAX_IN_FLIGHT
    assert fresh.calls == ["b", "c"]
    holds["b"].set()
    taken = [engines.take(builds["b"])]
    engines.start_next(items[2])  # c still in flight: d, with its own environment, waits for it
    assert fresh.calls == ["b", "c"]
    holds["c"].set()
    engines._started[builds["c"]].result()
    engines.start_next(items[2])
    assert fresh.calls == ["b", "c", "d"]
    holds["d"].set()
    taken += [engines.take(builds[name]) for name in "cd"]
    for engine in taken:
        engines.close_soon(engine)
    engines.finish()


def test_a_start_waits_for_its_own_threads_process_not_anothers():
    """``_has_children``: a thread's children only (another start's processes never end the wait),
    once they run their own program (``Popen`` returns after the child's exec)."""
    ids, spawned, release = {}, threading.Event(), threading.Event()

    def run(name, spawn):
        ids[name] = [threading.get_native_id()]
        if not spawn:
            assert release.wait(60)
            return
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        spawned.set()
        assert release.wait(60)
        process.kill()
        process.wait()

    threads = [threading.Thread(target=run, args=(name, name == "spawner")) for name in ("quiet", "spawner")]
    for thread in threads:
        thread.start()
    assert spawned.wait(60)
    try:
        assert engines._has_children(ids["spawner"]) and not engines._has_children(ids["quiet"])
        assert not engines._has_children([])  # the thread has not recorded its id yet
        ended = threading.Thread(target=lambda: ids.setdefault("ended", [threading.get_native_id()]))
        ended.start()
        ended.join()
        assert not engines._has_children(ids["ended"])  # its task is gone
    finally:
        release.set()
        for thread in threads:
            thread.join()


def test_an_engine_the_beginning_module_needs_is_not_started_ahead_nor_a_taken_one_again(fresh):
    build_s = fresh.make("session", "conftest")
    engines.fixture(build_s, "gc_llm", scope="session")
    build_c = fresh.make("c", "test_c")
    engines.fixture(build_c, "c_llm")
    items = session(("test_a", ["gc_llm"]), ("test_b", ["gc_llm"]), ("test_c", ["c_llm"]), ("test_d", ["gc_llm"]))
    engines.start_next(items[0])  # test_a's own fixture builds the session engine: test_c's starts
    assert fresh.calls == ["c"]
    held = engines.take(build_s)
    engines.start_next(items[2])
    engines.start_next(items[4])  # test_d needs the session engine, already taken
    taken = engines.take(build_c)
    assert taken.name == "c" and fresh.calls == ["c", "session"]
    engines.close_soon(held)
    engines.close_soon(taken)
    engines.finish()


def start_one_ahead(fresh, **faults):
    """test_a, then test_b needing ``b_llm``: test_a's first test starts b's build (``faults``: ``make``'s)."""
    build_b = fresh.make("b", "test_b", **faults)
    engines.fixture(build_b, "b_llm")
    engines.start_next(session(("test_a", []), ("test_b", ["b_llm"]))[0])
    return build_b


def test_a_failed_start_raises_in_the_fixture_that_takes_it(fresh):
    build_b = start_one_ahead(fresh, fail=True)
    with pytest.raises(RuntimeError, match="b did not start"):
        engines.take(build_b)
    engines.finish()


def test_finish_closes_an_engine_nobody_took_and_raises_a_failed_close(fresh):
    build_b = start_one_ahead(fresh, fail_close=True)  # test_b deselected: never taken
    engine = engines._started[build_b].result()
    with pytest.raises(RuntimeError, match="b did not close"):
        engines.finish()
    assert engine.closed.is_set() and not engines._started and not engines._closing


def test_scratch_directories_are_removed_when_the_session_finishes(fresh):
    made = [engines.scratch("tier"), engines.scratch("storage")]
    (made[0] / "entry.bin").write_bytes(b"x")
    assert all(path.is_dir() for path in made) and made[0] != made[1]
    engines.finish()
    assert not any(path.exists() for path in made)


def test_a_command_run_ahead_is_taken_with_its_output_and_leaves_nothing_to_close(fresh):
    def build():
        return engines.run_ahead("platform", ["--terse"])

    build.__module__ = "test_b"
    engines.fixture(build, "b_run")
    engines.start_next(session(("test_a", []), ("test_b", ["b_run"]))[0])
    done = engines.take(build)
    assert done.returncode == 0 and done.stdout.strip() and done.args[1:3] == ["-m", "platform"]
    engines.close_soon(done)
    assert not engines._closing
    engines.finish()


class FakeServer:
    def __init__(self):
        self.stops = 0

    def stop(self):
        self.stops += 1


def test_a_soaks_servers_launched_ahead_stop_when_nobody_takes_them(fresh):
    servers = (FakeServer(), FakeServer())

    def build():
        return engines.Ahead("the soak's run", servers)

    build.__module__ = "test_b"
    engines.fixture(build, "b_soak")
    engines.start_next(session(("test_a", []), ("test_b", ["b_soak"]))[0])  # test_b deselected: never taken
    engines.finish()
    assert [server.stops for server in servers] == [1, 1]


def test_a_command_a_build_runs_later_sees_the_environment_of_the_builds_start(fresh, tmp_path, monkeypatch):
    """A build's later console script runs in the environment its start saw, not one a test changed since."""
    (tmp_path / "print_late.py").write_text("import os; print(os.environ.get('GRAPHCHUNK_TEST_LATE'))")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    changed = threading.Event()

    def build():
        first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the start returns
        assert changed.wait(60)
        first.kill()
        first.wait()
        return engines.run_ahead("print_late", [])

    build.__module__ = "test_b"
    engines.fixture(build, "b_run")
    engines.start_next(session(("test_a", []), ("test_b", ["b_run"]))[0])
    monkeypatch.setenv("GRAPHCHUNK_TEST_LATE", "set after the start")
    changed.set()
    done = engines.take(build)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stdout + done.stderr
    engines.finish()


@pytest.mark.parametrize("ahead", [True, False])
def test_a_builds_own_environment_reaches_its_processes_and_no_test(fresh, tmp_path, monkeypatch, ahead):
    """A build's ``environment`` is in its first process and the console scripts it runs later, and
    in this process only until that first process spawned (ahead) or the build returned (built by
    its fixture, the module run alone)."""
    (tmp_path / "print_own.py").write_text("import os; print(os.environ.get('GRAPHCHUNK_TEST_OWN'))")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("GRAPHCHUNK_TEST_OWN", raising=False)
    first_saw = tmp_path / "first.txt"

    def build():
        first = subprocess.Popen([sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write("
                                  "os.environ.get('GRAPHCHUNK_TEST_OWN', 'None')); time.sleep(600)", str(first_saw)])
        later = engines.run_ahead("print_own", [])
        return FakeEngine("own", first), later

    build.__module__ = "test_b"
    engines.fixture(build, "b_own", environment={"GRAPHCHUNK_TEST_OWN": "own"})
    if ahead:
        engines.start_next(session(("test_a", []), ("test_b", ["b_own"]))[0])
        assert "GRAPHCHUNK_TEST_OWN" not in os.environ  # the start returned: no test sees it
    engine, later = engines.take(build)
    assert "GRAPHCHUNK_TEST_OWN" not in os.environ
    assert later.returncode == 0 and later.stdout.strip() == "own", later.stdout + later.stderr
    poll(lambda: first_saw.exists() and first_saw.read_text(), 60, interval=0.05)
    assert first_saw.read_text() == "own"
    engine.shutdown()
    engines.finish()


def test_a_dead_servers_metrics_raise_with_its_exit_and_log(tmp_path):
    """A run that reads /metrics of a server that died says so, with the end of its log (a CI soak
    once showed only "Connection refused")."""
    import socket

    from perf.common.server import Servers

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once closed
    log = tmp_path / "server.log"
    log.write_text("started\nValueError: Counters can only be incremented by non-negative amounts.\n")
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    servers = Servers(None, None, 0, 0, tmp_path)
    servers.current = SimpleNamespace(url=f"http://127.0.0.1:{port}", log_path=log, process=process)
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*non-negative amounts"):
        servers.metrics()
