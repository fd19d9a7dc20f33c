"""Re-checking ``up``'s layout while it serves (issue 30): ``layout.py``'s model fed with the
step times the running workers learned from their own served steps instead of the probe's.

The probe times an engine alone; served, the same cores also run the coordinator, the gateway,
the relay threads and whatever else the machine does, and a layout's cost of sharing them
(an OpenMP step waiting on a preempted thread, a prompt step stalling the batch) shows only
there. Each worker learns its step-time model from every step it serves
(``common/step_cost.py:StepCost``, the model placement predicts with) and reports it in its
heartbeats; the coordinator lists it (``ListWorkers``). From those:

- ``served_phase``: the running layout's ``PhaseTimes`` as served: a probe-sized prompt from
  the prefill-role members' models, decode steps of 1 and ``BATCH`` requests over such a
  prompt from the decode-role members' (a dual-role worker is a member of each role, with one
  engine's model); None until each part has seen ``MIN_PROMPT_STEPS`` / ``MIN_DECODE_STEPS``
  steps;
- ``recheck``: ``layout.choose`` on the probe with the running layout's thread count's times
  replaced by the served ones (``ProbeResult.served`` marks them, ``ProbeResult.probed`` keeps
  the probe's). The other layout keeps its earlier served times (from a previous run of it),
  or else its probe's, which ``layout.comparable`` charges with the running layout's serving
  cost where the other runs on more threads; after a run of each, both sides of the
  comparison are served figures;
- ``recheck_layout``: ``up``'s loop: every ``interval_s`` it lists the workers, re-checks,
  writes the corrected probe back to the cache (so the next ``up`` chooses from served
  figures) and says the result: at the first re-check and whenever its choice changes.

It does not switch a running cluster: moving workers between layouts under load is not built;
the line says what a restart would run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.common.errors import SplitserveError
from splitserve.common.layout_probe import BATCH, PhaseTimes, ProbeResult
from splitserve.common.membership import MemberStatus, Role
from splitserve.launch.layout import (
    AGGREGATED_MARGIN,
    MODELLED,
    PAIR_LAYOUTS,
    LayoutChoice,
    Workload,
    cache_probe,
    choose,
    layout_phase,
)
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.membership_client import MembershipClient
from splitserve.proto.server import open_channel
from splitserve.proto.tls import TlsConfig

MIN_DECODE_STEPS = 64
"""Decode-only steps a decode member's model must have seen to stand for the layout."""
MIN_PROMPT_STEPS = 8
"""Steps with prompt tokens a prefill member's model must have seen."""
CALL_TIMEOUT_S = 5.0


def served_phase(
    probe: ProbeResult, layout: str, members: Sequence[MemberStatus]
) -> PhaseTimes | None:
    """``layout``'s phase times from the members' learned step models (means over the members
    of each role whose part is known); None while a part is not known yet."""
    prompt = probe.prompt_tokens
    costs = [(member.info.role, member.load.step_cost) for member in members]
    prefill = [c for r, c in costs if r is Role.PREFILL and c.prefill_steps >= MIN_PROMPT_STEPS]
    decode = [c for r, c in costs if r is Role.DECODE and c.decode_steps >= MIN_DECODE_STEPS]
    if not prefill or not decode:
        return None
    times = (
        statistics.fmean(cost.prefill_s(prompt) for cost in prefill),
        statistics.fmean(cost.decode_step_s(1, prompt) for cost in decode),
        statistics.fmean(cost.decode_step_s(BATCH, BATCH * prompt) for cost in decode),
    )
    if min(times) <= 0.0:
        return None
    return PhaseTimes(layout_phase(probe, layout).threads, *times)


def with_served(probe: ProbeResult, served: PhaseTimes) -> ProbeResult:
    """``probe`` with ``served`` in place of the times of its thread count, marked served; the
    probe's own times of that count stay in ``probed`` (the first ones probed, however often
    served times replaced them)."""
    phases = tuple(served if phase.threads == served.threads else phase for phase in probe.phases)
    marked = tuple(sorted({*probe.served, served.threads}))
    probed = tuple(probe.probed_phase(threads) for threads in marked)
    return dataclasses.replace(probe, phases=phases, served=marked, probed=probed)


@dataclass(frozen=True)
class Recheck:
    """One re-check of the running layout."""

    running: str
    probe: ProbeResult
    """The probe with the running layout's served times in (what ``choice`` read)."""
    choice: LayoutChoice

    @property
    def switch(self) -> bool:
        """Whether the served figures choose the other layout: the worker pair or the one
        worker on every core (``split`` and ``hybrid`` are one pair to the model)."""
        pair = {self.choice.layout, self.running} <= set(PAIR_LAYOUTS)
        return self.choice.layout != self.running and not pair

    def line(self) -> str:
        """The log line: the running layout's served times, each layout's predicted rate and
        where its figures came from, and what a restart would run."""
        served = layout_phase(self.probe, self.running)
        carried = {cost.target: cost.source for cost in self.choice.carried}

        def source(layout: str) -> str:
            threads = layout_phase(self.probe, layout).threads
            if threads in self.probe.served:
                return "served"
            if threads in carried:
                return f"probe x the serving cost on {carried[threads]} thread(s)"
            return "probe"

        rates = ", ".join(
            f"{layout} {rate:.2f} ({source(layout)})" for layout, rate in self.choice.capacities
        )
        verdict = (
            f"{self.choice.layout} is the choice now: the next `splitserve up` starts it "
            "(restart to switch now)"
            if self.switch
            else f"{self.running} stays the choice"
        )
        return (
            f"layout re-check from served steps: {self.running} computes a "
            f"{self.probe.prompt_tokens}-token prompt in {served.prefill_s * 1e3:.0f} ms, a "
            f"decode step in {served.decode_one_s * 1e3:.1f} ms (1 request) / "
            f"{served.decode_batch_s * 1e3:.1f} ms ({BATCH}); predicted req/s within the "
            f"targets: {rates} (aggregated needs {AGGREGATED_MARGIN:g}x hybrid's); {verdict}"
        )


def recheck(
    probe: ProbeResult, workload: Workload, running: str, members: Sequence[MemberStatus]
) -> Recheck | None:
    """The re-check of ``running`` (a layout the model knows) from ``members``; None while
    their models do not know both phases yet."""
    served = served_phase(probe, running, members)
    if served is None:
        return None
    corrected = with_served(probe, served)
    return Recheck(running, corrected, choose(corrected, workload))


async def recheck_layout(
    address: str,
    credential: ClusterCredential,
    tls: TlsConfig | None,
    choice: LayoutChoice,
    workload: Workload,
    interval_s: float,
    say: Callable[[str], None],
) -> None:
    """Re-check ``choice`` (its layout running, its probe cached at its ``probe_path``) every
    ``interval_s`` against the coordinator at ``address`` (its internal port), until
    cancelled. A failed call is skipped (the next interval asks again)."""
    if choice.probe is None or choice.probe_path is None or choice.layout not in MODELLED:
        return
    probe, path, last = choice.probe, choice.probe_path, None
    async with open_channel(address, tls) as channel:
        client = MembershipClient(channel, credential)
        while True:
            await asyncio.sleep(interval_s)
            try:
                members = await client.list_workers(CALL_TIMEOUT_S)
            except SplitserveError:
                continue
            result = recheck(probe, workload, choice.layout, members)
            if result is None:
                continue
            with contextlib.suppress(OSError):
                cache_probe(path, result.probe)
            if last is None or result.choice.layout != last.choice.layout:
                say(f"splitserve up: {result.line()}")
            last = result
