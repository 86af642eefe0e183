"""What the gateway measures: its Prometheus metrics (`metrics.py`) and the stitching of a request's worker
events onto the gateway's clock (`timeline.py`). Leaf modules every other room may record into; they import
nothing of the gateway. Request traces and their OTLP export are built where a generation ends
(`generation/request_trace.py`, `generation/tracing.py`); the `/dashboard` page is a route (`api/dashboard.py`).
"""
