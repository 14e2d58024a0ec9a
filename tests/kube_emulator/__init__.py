"""A test-only Kubernetes API emulator for the operator's integration tests.

No kube-apiserver, kind or envtest binary installs on the CI machines, and kmock (kopf's mock
server) did not serve kopf's list + watch (see /docs/operator.md, "The test emulator", for
what is modelled and what is not).
"""

from kube_emulator.server import KubeEmulator

__all__ = ["KubeEmulator"]
