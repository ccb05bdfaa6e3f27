"""SGLang workers for the router, one package per engine, one process handle for both.

``sim/`` is the SGLang-faithful simulated worker (docs/sim-worker.md); ``real/`` launches and installs real
SGLang (GPU launch help, SGLang 0.5.23 on this CPU; docs/real-sglang.md); ``process`` is the handle of a worker
process of either engine (``WorkerProcess``: addresses, log, ready wait, stop, kill, restart), whose children die
with the process that started them (``guard/sitecustomize.py``). ``prefix_router.fleet.start_fleet`` starts
fleets of either engine.
"""
