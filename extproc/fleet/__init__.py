"""What the router knows of its workers, shared by the request path and the sync path.

The worker model (``workers``), what a worker says of itself (``info``: page size, DP ranks, role)
and reports (``reports``: load, tier figures), the fleet's layout as a decision reads it
(``layout``), and the block index of what each worker's cache holds (``index``, keyed by
``blocks``). The sync path writes these, the decision reads them; neither path is imported here.
"""
