"""Die with the parent: loaded by every Python process of a worker started through ``sglang_workers.process``.

``WorkerProcess`` puts this directory first on the child's ``PYTHONPATH``, so Python imports this file at start-up
in the worker and in every Python process the worker starts itself (real SGLang's scheduler and detokenizer run in
processes of their own). Each asks the kernel (Linux ``PR_SET_PDEATHSIG``) for SIGKILL when the thread that started
it ends: a worker never outlives the process that started it, even when that process is SIGKILLed and has no chance
to stop it (``prefix-router up`` killed by its supervisor used to leave a 3.6 GB SGLang tree running).

``PREFIX_ROUTER_WORKER_PARENT`` carries the starter's pid to the worker: if the starter died before the request
was made (the kernel then has nobody to watch), the worker exits at once. It is removed from the environment, so
the worker's own children watch their own parent instead. Standard library only: this runs under any interpreter
(the project's ``.venv`` for the simulator, SGLang's own virtualenv for real SGLang); elsewhere than Linux it does
nothing.

With ``PREFIX_ROUTER_SGLANG_CPU_PD`` set (real SGLang prefill/decode workers on a CPU) it also installs the import
hook of ``sglang_cpu_pd.py``, the adjustment SGLang 0.5.23's PD path needs without CUDA.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys

PARENT_ENV = "PREFIX_ROUTER_WORKER_PARENT"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """Ask for SIGKILL when the parent goes; exit now if the parent named in the environment is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    expected = os.environ.pop(PARENT_ENV, None)
    if expected is not None and expected.isdigit() and os.getppid() != int(expected):
        os._exit(1)  # orphaned before the request took effect


die_with_parent()

if os.environ.get("PREFIX_ROUTER_SGLANG_CPU_PD"):  # a real SGLang PD worker on a CPU (see sglang_cpu_pd.py)
    # this directory is on the worker's sys.path (PYTHONPATH), so the sibling module imports by its own name
    importlib.import_module("sglang_cpu_pd").install()
