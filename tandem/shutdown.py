"""How long a stopping Tandem process lets running work finish (``--shutdown-grace``).

The one definition of the default for the scheduler, the workers, the router, ``tandem
serve`` and the operator's pods (docs/reliability.md, "Shutdown"). On SIGTERM a scheduler
or router stops admitting at once and lets running streams finish for up to the grace; a
worker keeps running the steps of a scheduler that still streams to it for up to its grace
(that scheduler may be stopping too: Kubernetes stops a cell's pods together).
"""

from __future__ import annotations

DEFAULT_GRACE_S = 30.0
# What a process needs after its grace to stop in order: the engine's last step, closing
# channels, unlinking the segment, flushing traces. Pods get their grace plus this before
# the kubelet kills them; a cell's workers wait this much longer than its scheduler.
STOP_MARGIN_S = 10.0

