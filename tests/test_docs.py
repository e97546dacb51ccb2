"""The README and the getting-started guide as a user reads them.

The front page fits a screen; every shell command they show runs as written, short of running it:
the program exists in the environment ``make`` built, its arguments parse with the program's own
parser, and a server command's engine configuration is built the way ``vllm serve`` builds it, with
graphchunk's start-up checks (the plugin's), so vanilla vLLM's flags plus ``--worker-cls
graphchunk.Runner`` are shown to start; every Python example compiles and imports names that exist;
the demo serves the README's server command. (``mkdocs build --strict`` runs in ``make test``.)
"""
from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from graphchunk.compat import vllm_name

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/getting-started.md")
MODEL_CALL = "$(.venv/bin/graphchunk-model smollm2)"
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def code_blocks(text: str) -> tuple[list[str], list[str]]:
    """A Markdown page's indented code blocks (shell) and its ```python fences."""
    shell, python, block, fence = [], [], [], None
    for line in text.splitlines() + [""]:
        if fence is not None:
            if line.startswith("```"):
                if fence == "python":
                    python.append("\n".join(block))
                fence, block = None, []
            else:
                block.append(line)
        elif line.startswith("```"):
            fence, block = line[3:].strip(), []
        elif line.startswith("    "):
            block.append(line[4:])
        else:
            if block:
                shell.append("\n".join(block))
            block = []
    return shell, python


def commands(block: str, model: str) -> list[list[str]]:
    """Each command of a shell block as argv: continuation lines and multi-line quotes joined,
    comments dropped, the model path and the ``MODEL`` placeholder filled in."""
    out, pending = [], ""
    for line in block.replace(MODEL_CALL, model).splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if argv:
            out.append([model if a == "MODEL" else a for a in argv if not re.fullmatch(r"<[^>]*>?|flags>", a)])
        pending = ""
    assert not pending, f"unterminated command: {pending!r}"
    return out


def page_commands(page: str, model: str) -> list[list[str]]:
    shell, _ = code_blocks((REPO / page).read_text())
    return [argv for block in shell for argv in commands(block, model)]


def serve_config(argv: list[str]):
    """The engine configuration ``vllm serve ARGV`` builds before it starts, graphchunk's checks included."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from graphchunk.engine.plugin import register

    register()
    args = vllm_name("make_arg_parser")(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    args.model = args.model_tag or args.model
    vllm_name("validate_parsed_serve_args")(args)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def check_command(argv: list[str]) -> None:
    program = argv[0].removeprefix(".venv/bin/")
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
        assert set(argv[1:]) <= set(targets), f"make targets {argv[1:]} not in the Makefile's {targets}"
    elif program == "pip":
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        wanted = re.findall(r"graphchunk\[(\w+)\]", " ".join(argv))
        assert wanted and set(wanted) <= set(extras), argv
    elif program == "curl":
        body = json.loads(argv[argv.index("-d") + 1])
        assert body["messages"] and body["documents"], body
    elif program in ("vllm", "graphchunk-vllm"):
        assert argv[1] == "serve", argv
        assert (Path(sys.executable).parent / "graphchunk-vllm").exists()
        config = serve_config(argv[2:])
        assert config.parallel_config.worker_cls == "graphchunk.Runner"
    elif program == "graphchunk-precompute":
        assert (Path(sys.executable).parent / program).exists()
        from graphchunk.tools.precompute import make_parser

        make_parser().parse_args(argv[1:])
    elif program == "mkdocs":
        assert (Path(sys.executable).parent / "mkdocs").exists()
    else:
        raise AssertionError(f"a command this test cannot check: {argv}")


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    for page in re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines)):
        assert (REPO / page).exists(), page


@pytest.mark.parametrize("page", PAGES)
def test_every_command_runs_as_written(page, smollm2_path):
    argvs = page_commands(page, str(smollm2_path))
    assert argvs, f"{page} shows no command"
    for argv in argvs:
        assert argv[0].removeprefix(".venv/bin/") in {*SCRIPTS, "make", "pip", "curl", "vllm", "mkdocs"}, argv
        check_command(argv)


@pytest.mark.parametrize("page", ("README.md", "docs/getting-started.md", "docs/documents.md"))
def test_python_examples_compile_and_import_what_exists(page):
    _, python = code_blocks((REPO / page).read_text())
    for source in python:
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{page}: {node.module}.{alias.name} does not exist"
        compile(tree, page, "exec")


def test_the_demo_serves_the_readmes_command(smollm2_path):
    from graphchunk.tools.serve_demo import DEMO_FLAGS

    model = str(smollm2_path)
    served = ["graphchunk-vllm", "serve", model, "--worker-cls", "graphchunk.Runner", *DEMO_FLAGS]
    shown = [[a.removeprefix(".venv/bin/") for a in argv] for argv in page_commands("README.md", model)]
    assert served in shown, f"the demo serves {served}; the README shows {shown}"


def test_vanilla_flags_plus_the_worker_start_with_the_pool_sized_inside_the_budget(smollm2_path):
    """The case from vLLM's own server tests: a 2 GiB KV-cache budget, no graphchunk setting (a fixed
    65536-token pool refused it); an explicit pool that does not fit is still refused."""
    from graphchunk.config import ConfigError

    flags = [str(smollm2_path), "--kv-cache-memory-bytes", "2147483648", "--max-model-len", "2048"]
    serve_config([*flags, "--worker-cls", "graphchunk.Runner"])
    with pytest.raises(ConfigError, match=r"graphchunk.pool_tokens=131072 needs \d+ bytes of KV cache but "
                                          r"--kv-cache-memory-bytes is 2147483648"):
        serve_config([*flags, "--worker-cls", "graphchunk.Runner",
                      "--additional-config", '{"graphchunk": {"pool_tokens": 131072}}'])
