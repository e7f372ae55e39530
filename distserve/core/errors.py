"""The two kinds of failure every layer tells apart: the request is at fault, or an instance is gone.

Anything else raised while serving is a bug: the servers answer it as an internal error (gRPC
INTERNAL, HTTP 500) and log its traceback, and it never counts as either of these.
"""

from __future__ import annotations


class RequestError(ValueError):
    """The request itself is wrong (empty prompt, bad sampling values, a duplicate id, a request that
    can never fit): its message says what to fix. Servers answer INVALID_ARGUMENT / HTTP 400."""


class InstanceFailure(RuntimeError):
    """An instance cannot serve any more: a worker died or failed, or no instance of a role is left.
    Servers answer UNAVAILABLE / HTTP 503."""


class InstanceStalled(InstanceFailure):
    """An instance still answers but its step loop has stopped moving (a worker stopped or swapped
    out, a collective waiting on a lost rank): it is fenced, as one that stopped answering is."""
