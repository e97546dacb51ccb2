"""Runs a console script's or a benchmark's ``main(argv)`` in the test process, as its command runs it.

Contract: ``run_main(main, argv, command)`` returns a ``subprocess.CompletedProcess`` (``command``
followed by ``argv``, the exit code, what it printed to stdout and stderr), with every environment
variable it set or changed put back. What the test saves is the new interpreter's import of torch,
transformers and vLLM (10-15 s on two cores); the engines and servers it starts are processes of
their own as under its command. Not captured: those processes' output (pytest's own capture shows
it with a failure).
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess


def run_main(main, argv: list[str], command: list[str]) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    environment = dict(os.environ)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # as the interpreter exits: None is 0, a message is printed and 1
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if code == 1 and not isinstance(exc.code, int):
                    print(exc.code, file=err)
    finally:
        os.environ.clear()
        os.environ.update(environment)
    return subprocess.CompletedProcess([*command, *argv], code, out.getvalue(), err.getvalue())
