"""Measurements of the router's parts in this process, no gateway: decisions, KV-event ingestion, pollers."""
