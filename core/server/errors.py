"""The server's errors: :class:`APIError` (a status, a message, the offending field) and its two shapes on
the wire, OpenAI's ``{"error": {message, type, param, code}}`` and, on ``/v1/messages``, Anthropic's
``{"type": "error", "error": {type, message}}`` (the field named in the message)."""

from __future__ import annotations

from typing import Optional

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}
#: Anthropic's error types by status (docs.anthropic.com, "Errors")
_ANTHROPIC = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
              503: "overloaded_error", 529: "overloaded_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        msg = self.message if not self.param or self.param in self.message else f"{self.param}: {self.message}"
        return {"type": "error", "error": {"type": _ANTHROPIC.get(self.status, "invalid_request_error"),
                                           "message": msg}}
