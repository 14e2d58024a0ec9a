"""Byte sizes as people write them in flags and manifests: ``256Mi``, ``1Gi``, ``4096``.

Kubernetes quantities (``Ki``, ``Mi``, ``K``, ``M``...) and the spellings of tools
(``MiB``, ``GiB``, ``MB``, ``GB``...) are all accepted: ``i`` means a power of 1024.
"""

from __future__ import annotations

_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_UNITS = {"": 1, "B": 1,
          **_DECIMAL, **{f"{k}B": v for k, v in _DECIMAL.items()}, "kB": 10**3,
          **{f"{k}i": 2**(10 * n) for n, k in enumerate(_DECIMAL, 1)},
          **{f"{k}iB": 2**(10 * n) for n, k in enumerate(_DECIMAL, 1)}}
_ACCEPTED = "bytes or a suffix Ki, Mi, Gi, Ti (also KiB, MiB...), K, M, G, T (also KB, MB...)"


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
            f"invalid size {text!r}: use {_ACCEPTED}"
        ) from None
    if value < 0:
        raise ValueError(f"invalid size {text!r}: must not be negative")
    return int(value * unit)
