"""The server's errors in OpenAI's schema, `{"error": {"message", "type", "param", "code"}}`, with vLLM's
type names and the HTTP status as the code."""

from __future__ import annotations

from typing import Any

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered with `status` and the OpenAI error body; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "InternalServerError" if self.status >= 500 else "BadRequestError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
