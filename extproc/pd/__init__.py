"""Prefill/decode disaggregation, entered only once a decision says a request is disaggregated.

``bootstrap`` (the pair's bootstrap fields as values), ``launch`` (the pair on the wire: prefill leg
first, refused pairs retried, decode aborted when its leg fails), ``prefill_leg`` (the leg's HTTP).
"""
