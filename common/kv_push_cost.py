"""What pushing a prompt's KV to a decode worker adds to its TTFT, learned by the prefill worker
from its own pushes (torch-free).

A prefill worker pushes a prompt's KV layer by layer while the prompt's last chunk computes
(``prefill/worker.py``): on a wide link the push ends with the compute, on a narrow one (or
for a long prompt whose KV outgrows what the link moves during that chunk) it ends later. The
*exposed* transfer is that later part: from the prompt's compute end (the worker has its first
token) to the last layer's sends completing. Over a link it grows with the KV pushed, less
the overlap, so it is modelled as linear in the prompt tokens whose KV travels (those after
the decode worker's cached prefix; a token's KV bytes are fixed by the layout, so per token is
per byte):

    exposed_s = base_s + per_token_s * pushed_tokens

(``KvPushCost``), fitted per decode worker (its address: one link) and over all of the
worker's pushes (``KvPushCosts``) by ``OnlineLinearFit`` (least squares, each push's weight
decaying by ``FORGETTING`` per later push, coefficients clamped at 0). Robust to noise: once a
link's fit is known, a push's exposed time counts as at most ``OUTLIER_FACTOR`` times what the
fit predicted for it (a cap never below ``OUTLIER_FLOOR_S``) before it is fitted, so one
stall (a GC pause, a retransmit) moves the figure by a bounded step (under twice the
prediction for the stalled prompt, where the recent pushes spread over prompt lengths) and
decays away with the pushes after it, while a link that really narrowed is still learned:
its first slow pushes are capped, each raising the prediction a step, until the fit has
caught up (from 10 ms to 2 s exposed in under thirty pushes).

Placement reads the figure (``coordinator/placement.py:PrefillView.push_cost``): each remote
TTFT adds the exposed transfer predicted for the prompt. A fit seen on fewer than
``MIN_PUSHES`` pushes is not known, and predicts 0 (the push assumed hidden, as before any
was measured).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.step_cost import OnlineLinearFit

MIN_PUSHES = 3
"""Pushes a fit must have seen before its figure is known (predicts anything but 0)."""
FORGETTING = 0.85
"""Each push's weight in a fit, per later push (a memory of some seven pushes: a link's load
changes faster than an engine's step times)."""
OUTLIER_FACTOR = 4.0
"""A known fit counts a push's exposed time as at most this many times its prediction."""
OUTLIER_FLOOR_S = 0.05
"""... and never caps it below this (a fit near 0, a link that was hiding every push, must
still learn that it narrowed)."""
TOKEN_SCALE = 1000.0
"""The fit's token feature is in thousands (keeps its normal equations well scaled)."""


@dataclass(frozen=True)
class KvPushCost:
    """One link's (or all links') exposed transfer model, seconds; see the module docstring."""

    base_s: float = 0.0
    per_token_s: float = 0.0
    pushes: int = 0
    """Pushes it was fitted on (0: none)."""

    @property
    def known(self) -> bool:
        return self.pushes >= MIN_PUSHES

    def exposed_s(self, pushed_tokens: int) -> float:
        """The exposed transfer predicted for a push of ``pushed_tokens`` tokens' KV; 0 while
        the figure is not known or nothing travels."""
        if not self.known or pushed_tokens <= 0:
            return 0.0
        return self.base_s + self.per_token_s * pushed_tokens


NO_PUSH_COST = KvPushCost()


@dataclass(frozen=True)
class KvPushCosts:
    """A prefill worker's learned push figures, as its load reports them: over all its pushes,
    and per decode worker it pushed to (by the address that decode worker registered, the one
    its reservations name). Empty for a worker that pushes nothing (a decode worker)."""

    overall: KvPushCost = NO_PUSH_COST
    peers: tuple[tuple[str, KvPushCost], ...] = ()
    """(decode worker address, that link's figure), one entry per address."""

    def to(self, decode_address: str) -> KvPushCost:
        """The figure for a push to ``decode_address``: that link's where known, else the
        one over all pushes (a link not measured yet: most likely alike, the prefill host's
        own link being shared), which may be unknown too."""
        for address, cost in self.peers:
            if address == decode_address and cost.known:
                return cost
        return self.overall


NO_PUSH_COSTS = KvPushCosts()


class ExposedPushFit:
    """One link's fit of exposed seconds on pushed tokens; ``estimate()`` is its current
    ``KvPushCost``. Not thread-safe (the prefill worker's event loop only)."""

    def __init__(self) -> None:
        self._fit = OnlineLinearFit(2, FORGETTING)
        self._estimate = NO_PUSH_COST

    def observe(self, pushed_tokens: int, exposed_s: float) -> None:
        """Learn from one completed push of ``pushed_tokens`` tokens' KV whose last send
        completed ``exposed_s`` after the prompt's compute ended (clipped as the module
        docstring says; a push of nothing teaches nothing)."""
        if pushed_tokens <= 0:
            return
        exposed_s = max(0.0, exposed_s)
        if self._estimate.known:
            cap = OUTLIER_FACTOR * self._estimate.exposed_s(pushed_tokens)
            exposed_s = min(exposed_s, max(cap, OUTLIER_FLOOR_S))
        self._fit.observe([1.0, pushed_tokens / TOKEN_SCALE], exposed_s)
        base, per_kilo_token = self._fit.coefficients()
        self._estimate = KvPushCost(base, per_kilo_token / TOKEN_SCALE, self._fit.num_observations)

    def estimate(self) -> KvPushCost:
        return self._estimate


class KvPushLearner:
    """A prefill worker's fits: one per decode worker address, and one over every push.
    Not thread-safe (the prefill worker's event loop only)."""

    def __init__(self) -> None:
        self._overall = ExposedPushFit()
        self._peers: dict[str, ExposedPushFit] = {}

    def observe(self, decode_address: str, pushed_tokens: int, exposed_s: float) -> None:
        """One completed push to ``decode_address`` (``ExposedPushFit.observe``)."""
        self._overall.observe(pushed_tokens, exposed_s)
        self._peers.setdefault(decode_address, ExposedPushFit()).observe(pushed_tokens, exposed_s)

    def forget(self, decode_address: str) -> None:
        """Drop a link's fit (the link itself was dropped: that decode worker is gone or
        idle); the figure over all pushes keeps what it taught."""
        self._peers.pop(decode_address, None)

    def estimate(self) -> KvPushCosts:
        return KvPushCosts(
            self._overall.estimate(),
            tuple((address, fit.estimate()) for address, fit in self._peers.items()),
        )
