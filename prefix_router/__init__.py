"""The prefix-router command and the local gateway stack (workers + router + Envoy on one machine)."""
