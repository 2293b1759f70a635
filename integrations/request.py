"""``Request``: one generation request of the engine, its tokens, progress and timing.

A request's context is ``token_ids`` (the prompt, then each generated token).
``num_computed`` tokens of it have their K/V in the cache; the scheduler picks
how many of the rest to compute in a step (a prefill chunk, or the one token
of a decode). When a step computes the whole context, the model's next token
is appended. A preempted request drops its cache (``num_computed = 0``) and
later recomputes its whole context, generated tokens included, so greedy
outputs do not change.

Timing is on the engine's clock (``time.perf_counter`` seconds): arrival (when
added, or the caller's trace time), first token, finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Request:
    """One request; mutated only by the engine's scheduler."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_preemptions: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None  # "length" or "stop"

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float | None:
        """Seconds from arrival to finish."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def append_token(self, token_id: int, now: float) -> None:
        """Record a generated token; finish on a stop token or at ``max_new_tokens``."""
        self.token_ids.append(token_id)
        if self.first_token_s is None:
            self.first_token_s = now
        if token_id in self.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_output_tokens >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.finish_s = now
