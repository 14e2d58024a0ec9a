"""The composition root: the ``tandem`` command, the local cell's process supervisor, the
clients and the trace viewer. It is the only package that imports the services
(``scheduler_svc``, ``worker_svc``, ``router_svc``, ``tandem_operator``), and nothing imports it
but tests and benchmarks."""
