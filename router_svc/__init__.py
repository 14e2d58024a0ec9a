"""The router: one ``tandem.v1.Generation`` endpoint in front of many cells.

It sends each request to the cell most likely to hold its cached image or prompt prefix
(consistent hashing with bounded load, health-aware) and streams the reply through. It is
its own Deployment, so it imports neither ``scheduler_svc`` nor ``worker_svc``.
"""
