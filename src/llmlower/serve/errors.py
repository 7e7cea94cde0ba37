"""Errors as OpenAI's API returns them: an HTTP status and {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)
TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}  # others: invalid_request


@dataclass
class APIError(Exception):
    """A request the server refuses (or cannot serve), as the client will see it."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None  # seconds, sent as Retry-After (429, 503)

    def body(self) -> dict:
        kind = TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def event(self) -> str:
        """The error as a server-sent event, for a stream that already started."""
        return f"data: {json.dumps(self.body())}\n\n"


def _field(location: tuple) -> str | None:
    """The request field a validation error points at: body.messages.0.content -> messages.0.content."""
    parts = [str(p) for p in location if p != "body"]
    return ".".join(parts) or None


def install(app: FastAPI) -> None:
    """Every error the app raises or FastAPI detects leaves in OpenAI's envelope (400, not FastAPI's 422)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        param = _field(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
            return APIError(400, message, None, "invalid_json").response()
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return APIError(400, message, param, "invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return APIError(500, "internal error (the details are in the server log)", None, "internal_error").response()
