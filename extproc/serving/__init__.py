"""The ``prefix-router serve`` process: the composition root, the command, the metrics port.

``app`` builds, starts and stops every collaborator in one place; ``command`` turns flags and the
config file into a running ``app``; ``processes`` runs several of them; ``metrics_http`` serves
``/metrics``.
"""
