"""The sync path: what the router knows about each worker, kept current in the background.

Read in order, per worker: ``workers`` (the set, and who is a candidate) <- ``health`` (``/health``
polls) and ``discovery`` (``/model_info``, ``/server_info``: model, page size, KV-event publishers);
``load`` (``/v1/loads`` polls); the KV-event write path ``hub`` -> ``subscriber`` (ZMQ SUB + replay)
-> ``cache_view`` (sequencing, re-keying) using ``event_wire`` (decoding) -> ``extproc.fleet.index``;
``shared_state`` (unconfirmed decisions shared between router replicas). Nothing here imports the
request path (router, policies, servicer); the request path reads what this path writes.
"""
