"""The benchmarks of prefix-router: every one is ``prefix-router bench --suite NAME`` (``suites/NAME.py``).

Shared machinery below the suites: ``workloads/`` (request lists), ``fleet/`` (clusters, contenders,
helper servers), ``client`` (the open-loop load generator), ``runs`` (one contender on a fresh cluster),
``metrics`` and ``stats`` (figures, percentiles, bootstrap intervals), ``oracle``, ``report``,
``matrix/``, ``virtual/`` (the virtual-clock fleet and the floor) and ``probes/`` (the router's parts
measured in process). ``gpu_timing.py`` is the one standalone script, run on a bare GPU machine.
"""
