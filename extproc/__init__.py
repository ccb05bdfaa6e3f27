"""Prefix-aware routing gateway for SGLang fleets: an Envoy ext_proc service.

The request path reads in order: ``request`` (parse the body) -> ``tokenization`` -> ``blocks``
(chained block keys) -> ``index`` (which worker holds which blocks, fed by ``events``) + ``load``
-> ``policies`` (choose) -> ``server`` (answer Envoy). See docs/architecture.md.
"""

__version__ = "0.1.0"
