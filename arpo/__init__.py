"""ARPO: agentic reinforced policy optimization for tool-calling LLM agents.

Importing the package sets the OpenMP environment of every arpo process (:data:`THREAD_ENV`), before torch
loads OpenMP, which reads it once: entry points (``python -m arpo.pipeline``, ``arpo.sft``, ``arpo.main_arpo``)
import ``arpo`` first, and Ray workers and engine cores get it from the job's runtime env
(:func:`arpo.runtime.ray_utils.init_ray`). A value already exported wins.
"""

import os

#: ``OMP_WAIT_POLICY=PASSIVE``: an OpenMP thread waiting for the others at the end of a parallel region sleeps
#: instead of spinning. Spinning is faster on an idle machine, but beside another busy process it takes the core
#: the straggling thread needs: beside one busy process a 2-thread SmolLM2 step ran 3.4x slower instead of the
#: fair 2x (2.2x passive) on a 2-core avx512_bf16 CPU, and 8x slower than passive on a loaded 2-core AVX2 CPU
#: (experiments/results/contention/).
THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}

for _key, _value in THREAD_ENV.items():
    os.environ.setdefault(_key, _value)
