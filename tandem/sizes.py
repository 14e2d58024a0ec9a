"""Byte sizes as people write them in flags and manifests: ``256Mi``, ``1Gi``, ``4096``."""

from __future__ import annotations

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes for ``text``; raises ValueError naming the accepted suffixes."""
    if isinstance(text, int):
        return text
    s = text.strip()
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if suffix and s.endswith(suffix):
            number, unit = s[: -len(suffix)], _UNITS[suffix]
            break
    else:
        number, unit = s, 1
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"invalid size {text!r}: use bytes or a suffix Ki, Mi, Gi, Ti, K, M, G, T"
        ) from None
    if value < 0:
        raise ValueError(f"invalid size {text!r}: must not be negative")
    return int(value * unit)
