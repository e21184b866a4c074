"""The last step of ``make install`` (scripts/install.sh): import the stack, print one line of its versions and the
CUDA devices torch sees.

The device note is there because a GPU install can succeed without a usable GPU (a CPU-only torch wheel picked by
the resolver, a driver too old for the wheel's CUDA, a login node without GPUs): the run would then fall back to
the CPU and be slow, or fail later. One line at install time says which case it is. On the CPU stack the line only
gains "no CUDA device: the CPU stack".

install.sh runs it as a file (``python scripts/install_check.py``): a failed import is then the stack's own, never
the ``arpo`` package's, and no module of the package can shadow one of the stack's (the script's folder comes first
on ``sys.path``, and this one holds no other Python file). Tests import its functions with torch stubbed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def cuda_note(torch: Any) -> str:
    """The CUDA devices ``torch`` sees, in words: names (with counts), how many, and the CUDA version torch was built
    for; or why there are none."""
    built_for = torch.version.cuda
    if built_for is None:
        return "no CUDA device: the CPU stack (torch built without CUDA)"
    count = torch.cuda.device_count()
    if count == 0:
        return f"no CUDA device visible (torch built for CUDA {built_for}: check the driver and CUDA_VISIBLE_DEVICES)"
    names = Counter(torch.cuda.get_device_name(i) for i in range(count))
    listed = ", ".join(f"{n} x {name}" for name, n in names.items())
    return f"CUDA: {count} device{'s' if count > 1 else ''} ({listed}), torch CUDA {built_for}"


def check_line(torch: Any, vllm: Any, transformers: Any, ray: Any) -> str:
    """The one line the install ends with: the versions of the stack's core packages, then :func:`cuda_note`."""
    return (f"ok: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}, "
            f"ray {ray.__version__}; {cuda_note(torch)}")


def main() -> None:
    import torch
    import vllm
    import transformers
    import ray

    print(check_line(torch, vllm, transformers, ray))


if __name__ == "__main__":
    main()
