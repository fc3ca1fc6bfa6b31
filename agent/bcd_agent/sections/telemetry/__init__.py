"""The `telemetry` section: bcd's OTLP export of its own metrics (docs/telemetry.md).

- model.py: TelemetrySpec, read strictly from the wire's TelemetrySection
- headers.py: the export headers from the secret's value
- plan.py: the pure planner (desired section, the exporter's running config, the headers' state)
- metrics.py: the metric model and NodeMetrics, which reads the node's parts
- otlp.py: the hand-written OTLP protobuf encoder
- exporter.py: the bounded, non-blocking OTLP/HTTP exporter (a trio service)
- section.py: TelemetrySection, the converger
"""
