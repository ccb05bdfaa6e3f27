"""Real SGLang: its router-ready flags, ``prefix-router sglang-launch``, and SGLang 0.5.23 on this CPU.

Modules: ``flags`` (the flags this router depends on, as data), ``launch_command`` (``prefix-router
sglang-launch``), ``installation`` (where the ``make sglang-cpu`` install lives, whether it is complete),
``install`` (``make sglang-cpu`` itself), ``cpu_launch`` (spawn a CPU worker behind ``sglang_workers.process``),
``cpu/`` (the ``libcuda.so.1`` stand-in's C source and the tiny-Llama builder). See docs/real-sglang.md.
"""
