"""Seeded bursty arrival traces: each tenant ramps up, holds a peak, and ramps down in its own window.

A tenant's arrival rate (requests/s) is ``base_rate`` plus a trapezoid of
height ``peak_rate``: up over ``ramp_s``, flat for ``hold_s``, down over
``ramp_s``. The windows of tenants ``0, 1, 2, ...`` follow each other, so at
any time at most one tenant is at its peak (like kvcached's ramp-up/ramp-down
traffic). Arrivals are a non-homogeneous Poisson process drawn by thinning;
each request has a random prompt (a shared per-tenant system prefix plus
random tokens) and a random output length. The same seed gives the same trace.

``steady_trace`` is the overload case: every tenant at one constant rate for a
while, the same request mix.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceShape:
    """The knobs of ``bursty_trace``; lengths are in tokens, times in seconds."""

    num_tenants: int = 3
    base_rate: float = 0.5
    peak_rate: float = 6.0
    ramp_s: float = 3.0
    hold_s: float = 6.0
    gap_s: float = 0.0  # quiet time between one tenant's window and the next
    lead_s: float = 2.0  # quiet time before the first window
    prefix_tokens: int = 64
    prompt_tokens: tuple[int, int] = (64, 320)  # after the prefix
    output_tokens: tuple[int, int] = (32, 96)
    vocab_size: int = 1024

    @property
    def window_s(self) -> float:
        return 2 * self.ramp_s + self.hold_s

    @property
    def duration_s(self) -> float:
        return 2 * self.lead_s + self.num_tenants * self.window_s + (self.num_tenants - 1) * self.gap_s

    def rate(self, tenant: int, t: float) -> float:
        """Arrivals per second of ``tenant`` at time ``t``."""
        start = self.lead_s + tenant * (self.window_s + self.gap_s)
        x = t - start
        if x <= 0 or x >= self.window_s:
            bump = 0.0
        elif x < self.ramp_s:
            bump = x / self.ramp_s
        elif x <= self.ramp_s + self.hold_s:
            bump = 1.0
        else:
            bump = (self.window_s - x) / self.ramp_s
        return self.base_rate + self.peak_rate * bump


@dataclass(frozen=True)
class Arrival:
    """One request of a trace."""

    time_s: float
    tenant: int
    prompt_ids: list[int]
    max_new_tokens: int


def bursty_trace(shape: TraceShape, seed: int) -> list[Arrival]:
    """Every tenant's arrivals over ``shape.duration_s``, sorted by time."""
    top = shape.base_rate + shape.peak_rate
    return _arrivals(shape, seed, top, shape.duration_s, shape.rate)


def steady_trace(shape: TraceShape, seed: int, rate: float, duration_s: float) -> list[Arrival]:
    """Every tenant at ``rate`` requests/s for ``duration_s`` (the shape's request mix), sorted."""
    return _arrivals(shape, seed, rate, duration_s, lambda _tenant, _t: rate)


def _arrivals(
    shape: TraceShape, seed: int, top: float, duration_s: float, rate: Callable[[int, float], float]
) -> list[Arrival]:
    """Poisson arrivals of each tenant at ``rate(tenant, t) <= top``, by thinning."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, shape.vocab_size) for _ in range(shape.prefix_tokens)]
                for _ in range(shape.num_tenants)]
    arrivals = []
    for tenant in range(shape.num_tenants):
        t = 0.0
        while True:
            t += rng.expovariate(top)
            if t >= duration_s:
                break
            if rng.random() * top > rate(tenant, t):
                continue  # thinned out
            num_prompt = rng.randint(*shape.prompt_tokens)
            prompt = prefixes[tenant] + [rng.randrange(3, shape.vocab_size) for _ in range(num_prompt)]
            arrivals.append(Arrival(t, tenant, prompt, rng.randint(*shape.output_tokens)))
    arrivals.sort(key=lambda a: a.time_s)
    return arrivals
