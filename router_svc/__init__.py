"""Cache-affine picking of a cell: the endpoint picker ``tandem epp`` (Envoy's ext_proc).

It tells Envoy which cell takes each request: the one most likely to hold its cached image
or prompt prefix (consistent hashing with bounded load, health-aware). Envoy carries the
bytes; the package holds no proxy. It is its own Deployment, so it imports neither
``scheduler_svc`` nor ``worker_svc``.
"""
