"""What the layout probe measured (``engine/layout_probe.py``), as ``up`` reads it (torch-free).

Contract: a ``ProbeResult`` holds one ``PhaseTimes`` per thread count probed, fewest threads
first; every time is in seconds and positive. ``served`` names the thread counts whose times
a serving cluster's learned step models replaced (the re-check writes them back to the
cache), and ``probed`` keeps the probe's own times of exactly those thread counts, so a
reader can tell what serving cost each of them. ``to_json`` / ``from_json`` round-trip it
exactly; ``from_json`` raises
``ValueError`` on anything else (a cache file from another version, say), so a reader can
probe again instead of trusting it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

BATCH = 8
"""Requests in the probe's second decode batch (its first has one)."""


def probe_thread_counts(cores: int) -> tuple[int, ...]:
    """Thread counts the probe times on a machine of ``cores`` allowed cores: what each of a
    split layout's two workers gets (half the cores, ``up``'s even split), then all of them."""
    if cores <= 0:
        raise ValueError("no cores")
    return tuple(sorted({max(1, cores // 2), cores}))


@dataclass(frozen=True)
class PhaseTimes:
    """One engine's phase times on ``threads`` cores."""

    threads: int
    prefill_s: float
    """One prompt of the probe's ``prompt_tokens``, computed alone (with its first token)."""
    decode_one_s: float
    """A decode-only step of one request over such a prompt."""
    decode_batch_s: float
    """A decode-only step of ``BATCH`` such requests."""

    def __post_init__(self) -> None:
        if self.threads <= 0:
            raise ValueError("threads must be positive")
        if min(self.prefill_s, self.decode_one_s, self.decode_batch_s) <= 0:
            raise ValueError("phase times must be positive")

    def decode_step_s(self, batch: float) -> float:
        """A decode step of ``batch`` requests (at least one), on the line through the two
        measured batches (extrapolated past ``BATCH``)."""
        return self.decode_one_s + self.decode_per_request_s * (max(1.0, batch) - 1)

    @property
    def decode_per_request_s(self) -> float:
        """What one more request adds to a decode step (never negative)."""
        return max(0.0, (self.decode_batch_s - self.decode_one_s) / (BATCH - 1))


@dataclass(frozen=True)
class ProbeResult:
    """The probe's answer for one machine, model and engine configuration."""

    cpu: str
    cores: int
    dtype: str
    prompt_tokens: int
    phases: tuple[PhaseTimes, ...]
    probe_s: float
    """How long the probe took, model load included."""
    served: tuple[int, ...] = ()
    """Thread counts whose times were learned from served steps (``launch/layout_recheck.py``)
    rather than probed: the other processes on the cores included."""
    probed: tuple[PhaseTimes, ...] = ()
    """The probe's own times of the ``served`` thread counts (in the same order), kept when
    served times replaced them in ``phases``."""

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a probe result needs at least one thread count")
        threads = [phase.threads for phase in self.phases]
        if threads != sorted(set(threads)):
            raise ValueError("phases must be in increasing thread counts")
        if not set(self.served) <= set(threads):
            raise ValueError("served names a thread count without phase times")
        if tuple(phase.threads for phase in self.probed) != tuple(sorted(self.served)):
            raise ValueError("probed must hold the probe's times of exactly the served counts")

    @property
    def all_cores(self) -> PhaseTimes:
        return self.phases[-1]

    @property
    def half_cores(self) -> PhaseTimes:
        """A split layout's worker: the fewest threads probed."""
        return self.phases[0]

    def probed_phase(self, threads: int) -> PhaseTimes:
        """The probe's own times on ``threads`` (served or not)."""
        for phase in (*self.probed, *self.phases):
            if phase.threads == threads:
                return phase
        raise KeyError(threads)

    def to_json(self) -> dict[str, object]:
        return {
            "cpu": self.cpu,
            "cores": self.cores,
            "dtype": self.dtype,
            "prompt_tokens": self.prompt_tokens,
            "probe_s": self.probe_s,
            "served": list(self.served),
            "phases": [_phase_json(phase) for phase in self.phases],
            "probed": [_phase_json(phase) for phase in self.probed],
        }

    @classmethod
    def from_json(cls, data: object) -> ProbeResult:
        try:
            if not isinstance(data, Mapping):
                raise TypeError("not an object")
            return cls(
                cpu=str(data["cpu"]),
                cores=int(data["cores"]),
                dtype=str(data["dtype"]),
                prompt_tokens=int(data["prompt_tokens"]),
                phases=tuple(_phase_of(phase) for phase in data["phases"]),
                probe_s=float(data["probe_s"]),
                served=tuple(int(threads) for threads in data.get("served", ())),
                probed=tuple(_phase_of(phase) for phase in data.get("probed", ())),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a layout probe result: {error}") from error

    def describe(self) -> str:
        """One line: each thread count's prompt and decode step times, in ms."""
        parts = [
            f"{phase.threads} thread{'s' if phase.threads > 1 else ''}"
            f"{' (served)' if phase.threads in self.served else ''}: a "
            f"{self.prompt_tokens}-token prompt {phase.prefill_s * 1e3:.0f} ms, decode step "
            f"{phase.decode_one_s * 1e3:.1f} ms (1 request) / {phase.decode_batch_s * 1e3:.1f} "
            f"ms ({BATCH})"
            for phase in self.phases
        ]
        return f"{self.cpu}, {self.dtype}: " + "; ".join(parts) + f" (probe {self.probe_s:.0f} s)"


def _phase_json(phase: PhaseTimes) -> dict[str, object]:
    return {
        "threads": phase.threads,
        "prefill_s": phase.prefill_s,
        "decode_one_s": phase.decode_one_s,
        "decode_batch_s": phase.decode_batch_s,
    }


def _phase_of(data: Mapping) -> PhaseTimes:
    """``_phase_json``'s inverse; ``KeyError`` / ``TypeError`` / ``ValueError`` on anything else."""
    return PhaseTimes(
        threads=int(data["threads"]),
        prefill_s=float(data["prefill_s"]),
        decode_one_s=float(data["decode_one_s"]),
        decode_batch_s=float(data["decode_batch_s"]),
    )
