"""Tooling around the router, not on any request's path.

``envoy_config`` generates the Envoy pieces (filters, clusters, routes, bootstrap) and
``envoy_config_command`` prints them (``prefix-router envoy-config``); ``stack`` runs workers, the
router and Envoy as child processes (``GatewayStack``); ``up_command`` is ``prefix-router up``.
The only part of ``extproc`` that may start simulated workers.
"""
