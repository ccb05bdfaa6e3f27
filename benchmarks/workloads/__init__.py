"""Benchmark workloads: deterministic request lists with arrival times, the same bytes for every contender.

``base`` (requests, one-token-word text, arrivals), ``generated`` (gsp, multi-turn, hot bursts, document
QA, long context, fan-out bursts), ``trace`` (Mooncake traces), ``flags`` (the one builder from a suite's
command line) and ``cells`` (the standard workloads at a size, for the matrix and the virtual fleet).
"""
