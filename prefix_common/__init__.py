"""What the router, the simulated and real workers and the command share, and nothing else imports back.

``tokenization`` (a model's chat template and tokenizer, as SGLang applies them) and ``addresses``
(worker URLs, ``host:port``, free ports). A leaf: it imports none of the project's other packages, so
the simulator can use it without depending on the router.
"""
