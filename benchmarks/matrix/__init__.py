"""The matrix (``--suite matrix``): every workload x offered load x fleet, every contender; its runner and report."""
