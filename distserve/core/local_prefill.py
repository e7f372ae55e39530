"""Per-request disaggregation (``cluster.local_prefill``): whether a request's prompt is prefilled
on a prefill instance, its KV then pulled by a decode instance, or by the decode instance that
will decode it, with no pull at all.

Disaggregation pays for itself on long prompts: their prefill would stall every decoding request
beside it for as long as it runs. A short prompt, or one whose prefix the decode instance holds in
its prefix cache already (the earlier turns of a conversation it decoded), costs a decode step
little more than a decode step, and sending it away costs a queue at the prefill instance, a
hand-over and a KV pull. The rule weighs the tokens the decode instance would compute, the prompt
less its cached prefix, against ``max_tokens``:

* ``off``: every request is disaggregated.
* ``on``: a request whose tokens to compute are at most ``max_tokens`` is prefilled by its decode
  instance, whatever the queues.
* ``auto``: as ``on``, judged against the queues: the decode instance's prompt tokens not yet
  prefilled plus this one's stay within ``max_tokens`` (a burst of short prompts does not pile up
  on it and stall its decoding for longer), and within what the least busy prefill instance has
  still to prefill with this prompt (the request's first token comes no later for being local).

The orchestrator's router applies it to each request it admits; the placement simulator applies
the same function to its simulated requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from distserve.core.config import is_int

LOCAL_PREFILL_MODES = ("off", "on", "auto")


@dataclass(frozen=True)
class LocalPrefillConfig:
    mode: str = "off"
    max_tokens: int = 256  # prompt tokens (less a cached prefix) a decode instance prefills itself

    def __post_init__(self) -> None:
        if self.mode not in LOCAL_PREFILL_MODES:
            raise ValueError(f"local_prefill.mode must be one of {', '.join(LOCAL_PREFILL_MODES)}, got '{self.mode}'")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"local_prefill.max_tokens must be an integer >= 1, got {self.max_tokens!r}")

    @classmethod
    def parse(cls, value: LocalPrefillConfig | dict | str | bool | None) -> LocalPrefillConfig:
        """From a config section: a mapping of its keys, or the mode alone. YAML reads a bare
        ``on`` and ``off`` as true and false, which mean those modes here."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, dict):
            value = {"mode": value}
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown local_prefill option(s): {', '.join(sorted(unknown))}")
        mode = value.get("mode", cls.mode)
        if isinstance(mode, bool):
            mode = "on" if mode else "off"
        return cls(**{**value, "mode": mode})


def prefill_locally(config: LocalPrefillConfig, to_compute: int, decode_queued: int, prefill_queued: int) -> bool:
    """Whether the decode instance prefills the request itself. ``to_compute``: the prompt tokens it
    would compute (the prompt less the prefix cached there); ``decode_queued``: prompt tokens already
    sent to it and not yet prefilled; ``prefill_queued``: those of the prefill instance the request
    would go to, with this prompt's own (less the prefix cached there)."""
    if config.mode == "off" or to_compute > config.max_tokens:
        return False
    if config.mode == "on":
        return True
    return decode_queued + to_compute <= min(config.max_tokens, prefill_queued)
