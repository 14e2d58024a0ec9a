"""The apiserver's error answer."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An apiserver error answer: HTTP status, Status reason, message."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
