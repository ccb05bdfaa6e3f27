"""SGLang workers for the router: an SGLang-faithful simulated worker, and real SGLang (GPU launch help, CPU).

Modules, one job each: ``config`` (the sim worker's typed settings), ``radix_cache`` (SGLang's prefix
tree and its KV events), ``kv_events`` (hashes, encodings, ZMQ publisher and replay), ``timing`` (GPU
timing profiles), ``scheduler`` (continuous batching on a simulated clock), ``load_report`` (the
``/v1/loads`` counters, counted as SGLang counts them), ``metrics`` (Prometheus text), ``responses``
(SGLang's bodies: meta_info, usage, errors), ``server`` (the HTTP API), ``sim_worker_command``
(``prefix-router sim-worker``), ``process`` (start sim workers as child processes: ``start_sim_worker``),
``sglang_flags`` and ``sglang_launch_command`` (``prefix-router sglang-launch``), ``sglang_cpu`` (real
SGLang 0.5.23 workers on this CPU) and ``sglang_cpu_install`` (``make sglang-cpu``).
See docs/sim-worker.md and docs/real-sglang.md.
"""
