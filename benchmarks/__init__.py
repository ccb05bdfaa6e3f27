"""Benchmarks that print figures: gateways and policies side by side, router overhead, hot paths."""
