"""Errors a client can be told about, each with its gRPC status code and HTTP status, so both
frontends refuse a request the same way."""

from __future__ import annotations

import logging

import grpc

from distserve.core.errors import InstanceFailure, RequestError, RequestFailed

logger = logging.getLogger(__name__)


class ServingError(Exception):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500
    error_type = "internal_error"  # the OpenAI error body's "type"


class InvalidRequest(ServingError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    error_type = "invalid_request_error"


class Unauthenticated(ServingError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    error_type = "authentication_error"


class PermissionDenied(ServingError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    error_type = "permission_error"


class Overloaded(ServingError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    error_type = "rate_limit_error"


class Unavailable(ServingError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    error_type = "service_unavailable"


def to_serving_error(error: BaseException) -> ServingError:
    """The client-facing form of an error raised while serving a request. Only a ``RequestError`` is
    the client's fault; a ``RequestFailed`` is an internal error of that request alone, logged with
    its traceback on its instance; anything unforeseen is an internal error, its traceback logged here."""
    if isinstance(error, ServingError):
        return error
    if isinstance(error, RequestError):
        return InvalidRequest(str(error))
    if isinstance(error, RequestFailed):
        return ServingError(str(error))
    if isinstance(error, InstanceFailure):
        return Unavailable(str(error))
    logger.error("internal error serving a request", exc_info=error)
    return ServingError(f"internal error: {type(error).__name__}: {error}")
