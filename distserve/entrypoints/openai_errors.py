"""``HTTPError``: how the OpenAI-compatible server refuses a request, with the fields of OpenAI's
error body."""

from __future__ import annotations

from typing import Any

from distserve.entrypoints.errors import ServingError


class HTTPError(Exception):
    """An HTTP error answer, with the fields of OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.error_type, self.param, self.code = status, error_type, param, code

    @classmethod
    def of(cls, error: ServingError) -> HTTPError:
        return cls(str(error), error.http_status, error.error_type)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": self.code}}
