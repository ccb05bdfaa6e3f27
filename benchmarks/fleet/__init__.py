"""What the benchmarks start: worker clusters, the gateways they compare, replicas, helper servers, /proc figures."""
