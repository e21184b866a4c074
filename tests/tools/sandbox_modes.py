"""The isolation backends the sandbox tests run under: each a pytest param, skipped with the reason where unusable."""

from __future__ import annotations

import pytest

from tools.python_sandbox import SandboxConfig, resolve_isolation


def isolation_params(uid_base: int) -> list:
    params = []
    for mode in ("bwrap", "unshare"):
        chosen, note = resolve_isolation(SandboxConfig(isolation=mode, uid_base=uid_base))
        marks = [] if chosen == mode else [pytest.mark.skip(reason=f"{mode} unusable here: {note} "
                                                                   "(scripts/install.sh installs bubblewrap)")]
        params.append(pytest.param(mode, marks=marks, id=mode))
    return params
