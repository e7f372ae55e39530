"""The role an instance plays in a cluster."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """Which phases an instance runs.

    A prefill instance runs prompts and keeps their KV until a decode instance pulls it; a decode
    instance takes requests over from prefill (and recomputes the ones it preempts); a colocated
    instance runs both phases of its own requests (the vLLM-style baseline). A ``str`` enum, so a
    role compares equal to its name in YAML, flags and messages.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | Role) -> Role:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"role must be one of {', '.join(r.value for r in cls)}, got '{value}'") from None


ROLES = tuple(r.value for r in Role)
