"""The SGLang-faithful simulated worker (``prefix-router sim-worker``; docs/sim-worker.md).

Modules, one job each. The worker: ``config`` (its typed settings), ``worker`` (``SimWorker``: the parts assembled,
readiness, the front-door length checks and ``submit``), ``command`` (``prefix-router sim-worker``), ``launch``
(spawn one behind ``sglang_workers.process``). Its front doors: ``http_api`` (the HTTP server and its info
endpoints), ``http_generation`` (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, with SSE),
``http_validation`` (request bodies checked as SGLang checks them), ``grpc_server`` and ``grpc_events`` (SGLang's
gRPC scheduler API and its KV-event stream), ``reports`` (``/server_info``, ``/model_info``, ``/v1/loads``: shared by
HTTP and gRPC), ``responses`` (SGLang's bodies: meta_info, usage, errors). The engine: ``request`` (one request's
state), ``scheduler`` (continuous batching on a simulated clock), ``admission`` (which waiting requests join the
next prefill batch), ``radix_cache`` and ``hiradix_cache`` (SGLang's prefix tree, and HiCache's host tier),
``hicache_storage`` (HiCache's L3 ``file`` storage), ``kv_events`` (hashes, encodings, ZMQ publisher and replay),
``timing`` (GPU timing profiles). What it reports: ``metrics`` (counters and histograms), ``load_report`` (the
``/v1/loads`` counters as SGLang counts them), ``prometheus`` (``/metrics`` text).
"""
