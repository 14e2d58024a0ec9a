"""JSON merge patch (RFC 7386) and JSON patch (RFC 6902: add, remove, replace, test), the two
patch types kopf sends; strategic merge patch is treated as a merge patch."""

from __future__ import annotations

import copy
from typing import Any

from kube_emulator.errors import ApiError


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def apply_json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """Apply `ops` to a copy of `doc`; a failed `test` or a bad path raises ApiError 422."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [_unescape(t) for t in op["path"].split("/")[1:]]
        node = doc
        try:
            for token in parents:
                node = node[int(token)] if isinstance(node, list) else node[token]
            if op["op"] == "test":
                current = node[int(last)] if isinstance(node, list) else node.get(last)
                if current != op["value"]:
                    raise ApiError(422, "Invalid", f"test failed at {op['path']}")
            elif op["op"] == "remove":
                del node[int(last) if isinstance(node, list) else last]
            elif op["op"] in ("add", "replace"):
                if isinstance(node, list):
                    index = len(node) if last == "-" else int(last)
                    if op["op"] == "add":
                        node.insert(index, op["value"])
                    else:
                        node[index] = op["value"]
                else:
                    node[last] = op["value"]
            else:
                raise ApiError(422, "Invalid", f"unsupported op {op['op']}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"cannot apply {op}: {e!r}") from e
    return doc
