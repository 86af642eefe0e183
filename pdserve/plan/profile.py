"""What the simulator knows of a host: times measured with the real runner, saved as JSON.

- prefill: one prompt of n tokens, no cached prefix, at each of `prefill_tokens`; and, where measured,
  the same n new tokens after a cached prefix of each of `prefix_tokens` (its KV read, not computed);
- decode: one step of a batch of b requests at context c, at each (b, c) of `decode_batch` x
  `decode_context`;
- transfer: the KV hand-off's seconds per prompt token (a page copy through shared memory, as between two
  workers of one host).

Between the measured points times are interpolated linearly (bilinearly for decode steps); past the last
point they are extrapolated from the last two.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended beyond both ends by the outer segments."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class Profile:
    host: str
    model: str
    dtype: str
    quantization: str
    threads: int
    prefill_tokens: list[int]
    prefill_s: list[float]
    decode_batch: list[int]
    decode_context: list[int]
    decode_s: list[list[float]]  # [batch index][context index]
    transfer_s_per_token: float
    chunked_prefill_size: int = 8192
    max_running_requests: int = 48
    # One host's forwards, k > 1 at once, progress at shared_efficiency / k each (1: perfect sharing).
    # Lock hand-offs, thread wake-ups and the serving path's own CPU make it less on a busy CPU host;
    # `pdserve plan --url` fits it to open-loop (Poisson) arrivals through the cluster (measure.fit_trace).
    shared_efficiency: float = 1.0
    # How one host's forwards share its cores (simulate.py): "turns" (`pdserve up`'s default: one forward
    # at a time, long ones offering their turn between `layers` equal slices when they have at least
    # `offer_min_tokens` tokens) or "processor" (all at once, each at 1/k of the speed).
    sharing: str = "processor"
    layers: int = 1
    offer_min_tokens: int = 256
    # Tokens of KV a decode worker holds (0: as many as it needs). A request joins a decode batch once its
    # prompt and whole answer fit beside the running ones' (or alone), as the pool's admission does.
    kv_tokens: int = 0
    devices: int = 1  # GPUs one worker spans (its TP size), as a saved profile records it
    notes: list[str] = field(default_factory=list)
    # prefix_s[i][j]: seconds to prefill prefill_tokens[j] new tokens after prefix_tokens[i] cached ones.
    # Empty (a profile from before, or one without room for a prefix): a cached prefix costs nothing.
    prefix_tokens: list[int] = field(default_factory=list)
    prefix_s: list[list[float]] = field(default_factory=list)

    def prefill(self, tokens: int, cached: float = 0) -> float:
        """Seconds of one prefill forward over `tokens` new prompt tokens (a batch's, summed), after a
        cached prefix of `cached` tokens (interpolated between the measured prefixes and none)."""
        fresh = _interp(self.prefill_tokens, self.prefill_s, tokens)
        if cached <= 0 or not self.prefix_tokens:
            return fresh
        after = [_interp(self.prefill_tokens, row, tokens) for row in self.prefix_s]
        return _interp([0, *self.prefix_tokens], [fresh, *after], cached)

    def decode(self, batch: int, context: float) -> float:
        """Seconds of one decode step of `batch` requests at mean context `context`."""
        per_batch = [_interp(self.decode_context, row, context) for row in self.decode_s]
        return _interp(self.decode_batch, per_batch, batch)

    def transfer(self, tokens: int) -> float:
        return self.transfer_s_per_token * tokens

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> Profile:
        with open(path) as f:
            data = json.load(f)
        profile = cls(**data)
        profile.check()
        return profile

    def check(self) -> None:
        """ValueError naming what is wrong with a hand-written or damaged profile."""
        if len(self.prefill_tokens) != len(self.prefill_s) or not self.prefill_tokens:
            raise ValueError("prefill_tokens and prefill_s must be lists of one length, not empty")
        if len(self.decode_s) != len(self.decode_batch) or any(
            len(row) != len(self.decode_context) for row in self.decode_s
        ):
            raise ValueError("decode_s must be len(decode_batch) rows of len(decode_context) seconds")
        for name in ("prefill_tokens", "decode_batch", "decode_context"):
            xs = getattr(self, name)
            if sorted(set(xs)) != xs or xs[0] < 1:
                raise ValueError(f"{name} must be increasing positive numbers")
        if min(self.prefill_s) < 0 or min(min(r) for r in self.decode_s) < 0 or self.transfer_s_per_token < 0:
            raise ValueError("times must not be negative")
        if not 0 < self.shared_efficiency <= 1:
            raise ValueError("shared_efficiency must be in (0, 1]")
        if self.sharing not in ("turns", "processor") or self.layers < 1 or self.offer_min_tokens < 1:
            raise ValueError('sharing must be "turns" or "processor", layers and offer_min_tokens >= 1')
        if len(self.prefix_s) != len(self.prefix_tokens) or any(
            len(row) != len(self.prefill_tokens) for row in self.prefix_s
        ):
            raise ValueError("prefix_s must be len(prefix_tokens) rows of len(prefill_tokens) seconds")
        if self.prefix_tokens and (
            sorted(set(self.prefix_tokens)) != self.prefix_tokens or self.prefix_tokens[0] < 1
        ):
            raise ValueError("prefix_tokens must be increasing positive numbers")
        if any(min(row) < 0 for row in self.prefix_s):
            raise ValueError("times must not be negative")
        if self.kv_tokens < 0 or self.devices < 1:
            raise ValueError("kv_tokens must be >= 0 and devices >= 1")
