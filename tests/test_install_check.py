"""scripts/install_check.py: the line `make install` ends with (versions, then the CUDA devices torch sees), with
torch's CUDA queries stubbed: no installer run, no GPU needed."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from arpo.config import REPO_ROOT


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("install_check", REPO_ROOT / "scripts" / "install_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_torch(version: str, cuda: str | None, devices: list[str]) -> SimpleNamespace:
    return SimpleNamespace(__version__=version, version=SimpleNamespace(cuda=cuda),
                           cuda=SimpleNamespace(device_count=lambda: len(devices),
                                                get_device_name=lambda i: devices[i]))


def stack(torch) -> dict:
    return dict(torch=torch, vllm=SimpleNamespace(__version__="0.32.0"),
                transformers=SimpleNamespace(__version__="5.19.0"), ray=SimpleNamespace(__version__="2.60.0"))


def test_the_cpu_stack_keeps_its_line_and_says_there_is_no_cuda_device(check):
    line = check.check_line(**stack(fake_torch("2.13.0+cpu", None, [])))
    assert line == ("ok: torch 2.13.0+cpu, vllm 0.32.0, transformers 5.19.0, ray 2.60.0; "
                    "no CUDA device: the CPU stack (torch built without CUDA)")


def test_the_gpu_stack_names_its_devices_their_count_and_torchs_cuda(check):
    one = check.check_line(**stack(fake_torch("2.13.0", "13.0", ["NVIDIA H200"])))
    assert one == "ok: torch 2.13.0, vllm 0.32.0, transformers 5.19.0, ray 2.60.0; " \
                  "CUDA: 1 device (1 x NVIDIA H200), torch CUDA 13.0"
    mixed = fake_torch("2.13.0", "13.0", ["NVIDIA H100 80GB HBM3"] * 3 + ["NVIDIA A100-SXM4-40GB"])
    assert check.cuda_note(mixed) == "CUDA: 4 devices (3 x NVIDIA H100 80GB HBM3, 1 x NVIDIA A100-SXM4-40GB), " \
                                     "torch CUDA 13.0"


def test_a_cuda_build_without_a_visible_device_says_so(check):
    note = check.cuda_note(fake_torch("2.13.0", "13.0", []))
    assert note == "no CUDA device visible (torch built for CUDA 13.0: check the driver and CUDA_VISIBLE_DEVICES)"


def test_the_real_torch_of_this_venv_gives_one_of_these_lines(check):
    import torch

    note = check.cuda_note(torch)
    if torch.version.cuda is None:
        assert note == "no CUDA device: the CPU stack (torch built without CUDA)"
    elif torch.cuda.device_count():
        assert note.startswith(f"CUDA: {torch.cuda.device_count()} device") and torch.version.cuda in note
    else:
        assert note.startswith("no CUDA device visible")
