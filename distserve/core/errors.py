"""The kinds of failure every layer tells apart: the request is at fault, one request's step
failed, or an instance is gone.

A request's own fault never fails an instance over, and an instance's fault never ends a request
that could run elsewhere: a request refused at the door is a ``RequestError``; one whose step
failed on an instance (its sampling, logits processors, grammar, a NaN in its logits) ends alone
with a ``RequestFailed`` (or a ``RequestError`` when its own values caused it), and is not run
again, since it would fail the same way anywhere; only an ``InstanceFailure`` re-runs requests
elsewhere. Anything else raised while serving is a bug: the servers answer it as an internal
error (gRPC INTERNAL, HTTP 500) and log its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class RequestError(ValueError):
    """The request itself is wrong (empty prompt, bad sampling values, a duplicate id, a request that
    can never fit): its message says what to fix. Servers answer INVALID_ARGUMENT / HTTP 400."""


class RequestFailed(RuntimeError):
    """One request's step failed on an instance and the request ended there, alone; its message
    names the request and what failed. The instance and the other requests of its batch went on.
    Servers answer INTERNAL / HTTP 500: the request was valid, serving it failed."""


@dataclass(frozen=True)
class RequestFault:
    """Why one request's step failed, as its final delta carries it from the instance (an
    exception's class and traceback stay where it was raised, in that instance's log)."""

    message: str  # what failed; ``of_request`` names the request
    invalid: bool = False  # its own values caused it (a RequestError): INVALID_ARGUMENT, else INTERNAL
    request_id: str | None = None

    @classmethod
    def of(cls, where: str, error: BaseException) -> RequestFault:
        """The fault of a request whose ``where`` (its sampling, say) raised ``error``."""
        invalid = isinstance(error, RequestError)
        return cls(f"its {where} failed: {error if invalid else f'{type(error).__name__}: {error}'}", invalid)

    def of_request(self, request_id: str) -> RequestFault:
        """The fault named for ``request_id``: the engine's id, or the id its client sent (the
        orchestrator's runs have ids of their own)."""
        return replace(self, request_id=request_id)

    def __str__(self) -> str:
        return self.message if self.request_id is None else f"request '{self.request_id}': {self.message}"

    def error(self) -> RequestError | RequestFailed:
        """The exception a caller of the request gets."""
        return RequestError(str(self)) if self.invalid else RequestFailed(str(self))


class InstanceFailure(RuntimeError):
    """An instance cannot serve any more: a worker died or failed, or no instance of a role is left.
    Servers answer UNAVAILABLE / HTTP 503."""


class InstanceStalled(InstanceFailure):
    """An instance still answers but its step loop has stopped moving (a worker stopped or swapped
    out, a collective waiting on a lost rank): it is fenced, as one that stopped answering is."""
