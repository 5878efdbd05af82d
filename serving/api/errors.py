"""OpenAI-style API errors: `APIError` (status, message, `param`) and its JSON body
`{"error": {"message", "type", "param", "code"}}`; how engine exceptions map to a status
(ValueError and KV-transfer parameter errors → 400, anything else → 500, logged). The statuses
and when each is used: `serving/api/server.py`'s module docstring."""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from serving.api.protocol import (
    ErrorInfo,
    ErrorResponse,
)
from serving.pd.params import KVTransferParamsError

logger = logging.getLogger(__name__)


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered to the client as an OpenAI error body with `status_code`."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param

    def to_response(self) -> ErrorResponse:
        """The OpenAI error body for this error."""
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=_ERROR_TYPES.get(self.status_code, "APIError"),
                param=self.param,
                code=self.status_code,
            )
        )


def error_json(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status_code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    errors = e.errors()
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid value')}")
    first_loc = errors[0].get("loc", ()) if errors else ()
    param = next((str(x) for x in first_loc if x != "body"), None)
    return bad_request("Invalid request: " + "; ".join(parts), param)


def engine_error(e: BaseException, request_id: str) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, KVTransferParamsError):
        return bad_request(str(e), e.param)
    if isinstance(e, ValueError):  # a StructuredOutputsError names its field too
        return bad_request(str(e), getattr(e, "param", None))
    logger.exception("Engine error for request %s", request_id, exc_info=e)
    return APIError(500, f"Internal server error: {type(e).__name__}: {e}")
