"""Label selectors: equality (`k=v`, `k==v`, `k!=v`), existence (`k`, `!k`) and sets
(`k in (a,b)`, `k notin (a,b)`), comma-separated and AND-ed."""

from __future__ import annotations

import re
from typing import Any

_SET = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _terms(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return [t.strip() for t in terms if t.strip()]


def _holds(term: str, labels: dict[str, str]) -> bool:
    m = _SET.match(term)
    if m:
        values = {v.strip() for v in m.group(3).split(",")}
        inside = labels.get(m.group(1)) in values
        return inside if m.group(2) == "in" else not inside
    if "!=" in term:
        key, value = term.split("!=", 1)
        return labels.get(key.strip()) != value.strip()
    if "=" in term:
        key, value = term.replace("==", "=").split("=", 1)
        return labels.get(key.strip()) == value.strip()
    if term.startswith("!"):
        return term[1:].strip() not in labels
    return term in labels


def matches(selector: str, obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(_holds(term, labels) for term in _terms(selector or ""))
