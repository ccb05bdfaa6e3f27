"""The routing decision as a pipeline read in order, with no I/O of its own.

request (the parsed body) -> ``prompt`` (render, tokenize, block keys; ``key_cache`` reuses them)
-> ``pipeline`` (match in the index -> ``pruning`` -> ``policies`` -> pin the DP rank) -> a decision.
"""
