"""The suites of ``prefix-router bench``, one module each with ``configure(parser)`` and ``main(args)``.

``compare`` (the default, ``--suite routing``), ``tiered`` (``--suite tiered``) and ``matrix_suite``
(``--matrix``) here; the overhead suite (``--suite overhead``) is ``benchmarks.router_overhead``, which
is also ``python -m benchmarks.router_overhead``. ``shared`` holds the flags several suites take.
"""
