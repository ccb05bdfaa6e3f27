"""The router as a service: one decision per request, its in-flight accounting, flow control and telemetry.

``router`` reads the fleet once per request, prepares the prompt off the event loop, waits in
``flow_control`` past saturation, runs the decision pipeline and records it (``telemetry``).
"""
