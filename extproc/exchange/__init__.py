"""The Envoy ext_proc / Endpoint Picker exchange: messages in, replies out.

``servicer`` (the gRPC stream, both body modes), ``epp`` (the EPP protocol's inputs), ``response``
(every reply Envoy gets). Prefill/decode pairs are handed to a launcher the serving layer plugs in.
"""
