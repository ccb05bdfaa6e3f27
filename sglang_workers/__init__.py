"""SGLang workers for the router: an SGLang-faithful simulated worker, and launch help for real SGLang.

Modules, one job each: ``config`` (the sim worker's typed settings), ``radix_cache`` (SGLang's prefix
tree and its KV events), ``kv_events`` (hashes, encodings, ZMQ publisher and replay), ``timing`` (GPU
timing profiles), ``scheduler`` (continuous batching on a simulated clock), ``metrics`` (Prometheus
text), ``server`` (the HTTP API), ``sim_worker_command`` (``prefix-router sim-worker``), ``process`` (start sim
workers as child processes: ``start_sim_worker``), ``sglang_launch_command`` (``prefix-router sglang-launch``).
See docs/sim-worker.md and docs/real-sglang.md.
"""
