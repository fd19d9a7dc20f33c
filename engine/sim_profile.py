"""A simulated engine's step-time profile: the step-cost model fitted to a real engine's steps.

A profile is ``common/step_cost.py``'s linear model (decode: base + per request + per context
token; prefill: base + per prompt token) with what it was fitted on: the model, the CPU, the
threads and dtype of the engine that ran the steps, how many steps, and the model's error on
steps it was not fitted on (MAPE, mean absolute percentage error). ``engine/sim_calibrate.py``
makes one by running a real engine; ``engine/sim_runner.py`` waits out its predictions.

The file is JSON (``SimProfile.to_json``); ``"default"`` names the profile shipped with the
project (``sim_profiles/default.json``): fitted to the 4,157 steps ``make serve``'s two
workers logged (``StepLog``) while serving the chat workload at 1, 2 and 3 req/s on the AMD
EPYC development machine (the default model, bf16 reading its quantized weights, one core
each), so it carries the interference a served step meets; held-out MAPE 11%. Simulated
``make serve`` against the real one: bench/log/2026-11.md, "A simulated worker". Torch-free.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from splitserve.common.errors import ModelLoadError
from splitserve.common.step_cost import MIN_STEPS, StepCost, StepCostLearner, StepShape

DEFAULT_PROFILE = Path(__file__).parent / "sim_profiles" / "default.json"
PROFILE_VERSION = 2


@dataclass(frozen=True)
class StepRecord:
    """One real step: its shape (``SchedulerOutput.shape``) and wall seconds."""

    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class SimProfile:
    """The step times a simulated engine reproduces, and where they came from."""

    step_cost: StepCost
    model_name: str
    cpu: str
    """The CPU model the real steps ran on (``lscpu``'s model name)."""
    threads: int
    """The real engine's torch threads."""
    dtype: str
    steps: int
    """Real steps the coefficients were fitted on."""
    mape: float
    """Mean absolute percentage error of the model on held-out real steps (0.05 = 5%)."""
    kv_bytes_per_token: int = 0
    """The real model's KV cache bytes per token, every layer (0: not recorded)."""
    transfer_gbps: float = 0.0
    """Measured KV transfer bandwidth between two worker processes, Gbit/s (0: not
    measured: a simulated transfer then takes what its stand-in bytes take)."""
    transfer_latency_s: float = 0.0
    """Measured one-way time of a small message between them."""
    startup_s: float = 0.0
    """Measured time from starting a worker process to its first token (0: not measured)."""
    step_ratio_quantiles: tuple[float, ...] = ()
    """The real decode-only steps' times over the model's predictions, at evenly spaced
    quantiles (the first the smallest, the last the largest): a simulated step lasts the
    prediction times a ratio drawn from them (``draw_ratio``), so the steps' spread is the
    real one, not only their mean (a least-squares model predicts the mean; GC pauses and
    neighbours make real steps' median shorter than it). Empty: every step lasts the
    prediction."""
    prefill_ratio_quantiles: tuple[float, ...] = ()
    """The same for steps that compute prompt tokens."""
    version: int = PROFILE_VERSION
    """The file's format: 1 had the step-time model only; 2 adds the KV, transfer and
    start-up figures (a version 1 file reads with them 0)."""

    def draw_ratio(self, uniform: float, computes_prompt: bool = False) -> float:
        """The step-time ratio at ``uniform`` (in [0, 1)) of ``step_ratio_quantiles`` (of
        ``prefill_ratio_quantiles`` for a step that ``computes_prompt``), linearly between
        the quantiles; 1.0 without them."""
        quantiles = self.prefill_ratio_quantiles if computes_prompt else self.step_ratio_quantiles
        if not quantiles:
            return 1.0
        position = uniform * (len(quantiles) - 1)
        low = int(position)
        high = min(low + 1, len(quantiles) - 1)
        return quantiles[low] + (quantiles[high] - quantiles[low]) * (position - low)

    def transfer_s(self, num_tokens: int) -> float:
        """The time a prompt of ``num_tokens`` tokens' KV takes over the measured link, all
        layers (0 where the link was not measured)."""
        if self.transfer_gbps <= 0:
            return 0.0
        return self.transfer_latency_s + num_tokens * self.kv_bytes_per_token * 8 / (
            self.transfer_gbps * 1e9
        )

    def step_s(self, shape: StepShape) -> float:
        """The seconds a real step of this shape takes, by the model."""
        return self.step_cost.step_s(shape)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "profile") -> SimProfile:
        """Parse ``to_json``'s output; ``ModelLoadError`` naming ``source`` when it is not one."""
        try:
            raw = json.loads(text)
            cost = StepCost(**raw.pop("step_cost"))
            raw.setdefault("version", 1)  # written before the version was recorded
            for name in ("step_ratio_quantiles", "prefill_ratio_quantiles"):
                raw[name] = tuple(raw.get(name, ()))
            profile = cls(step_cost=cost, **raw)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ModelLoadError(f"{source} is not a simulation profile: {exc}") from exc
        if profile.version > PROFILE_VERSION:
            raise ModelLoadError(
                f"{source} is a version {profile.version} profile; this splitserve reads "
                f"up to version {PROFILE_VERSION}"
            )
        if not (cost.knows_decode and cost.knows_prefill):
            raise ModelLoadError(f"{source}: a profile must be fitted on decode and prefill steps")
        return profile


class StepLog:
    """Appends every step of one engine to ``<directory>/steps-<pid>.jsonl`` (created), so a
    profile can be fitted to a serving worker's own steps, interference of its neighbours
    included (``sim_calibrate --from-steps``): a first line with what ran the steps, then
    one ``[decode_seqs, prefill_tokens, context_tokens, seconds]`` line per step, each
    written through (a few microseconds a step; a killed worker loses nothing written)."""

    def __init__(self, directory: str | Path, header: dict[str, object]) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"steps-{os.getpid()}-{id(self):x}.jsonl"
        self._file = self.path.open("a", encoding="utf-8", buffering=1)
        self._file.write(json.dumps(header) + "\n")

    def write(self, shape: StepShape, seconds: float) -> None:
        line = [shape.decode_seqs, shape.prefill_tokens, shape.context_tokens, seconds]
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_logs(paths: Iterable[Path]) -> list[StepRecord]:
    """Every step of these ``StepLog`` files, in file order; ``ModelLoadError`` naming the
    file and line of anything else."""
    records = []
    for path in paths:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if number == 1:
                    continue  # the header
                try:
                    decode_seqs, prefill_tokens, context_tokens, seconds = json.loads(line)
                    shape = StepShape(int(decode_seqs), int(prefill_tokens), int(context_tokens))
                except (ValueError, TypeError) as exc:
                    raise ModelLoadError(f"{path}:{number} is not a step record: {exc}") from exc
                records.append(StepRecord(shape, float(seconds)))
    return records


def load_profile(name_or_path: str | Path) -> SimProfile:
    """The profile in a file, or the shipped one for ``"default"``; ``ModelLoadError`` for a
    file that is missing or not a profile."""
    path = DEFAULT_PROFILE if str(name_or_path) == "default" else Path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelLoadError(f"cannot read the simulation profile {path}: {exc}") from exc
    return SimProfile.from_json(text, str(path))


def fit_step_cost(records: Sequence[StepRecord]) -> StepCost:
    """Least squares over every record (no forgetting): the online learner's model, fitted
    on all of them at once."""
    learner = StepCostLearner(forgetting=1.0)
    for record in records:
        learner.observe(record.shape, record.seconds)
    return learner.estimate()


def mape(cost: StepCost, records: Sequence[StepRecord]) -> float:
    """Mean absolute percentage error of ``cost`` on ``records``."""
    return statistics.fmean(
        abs(cost.step_s(record.shape) - record.seconds) / record.seconds for record in records
    )


RATIO_QUANTILES = 101
"""Points ``step_ratio_quantiles`` keeps: every 1%, the extremes included. (Every 5% put a
twentieth of the draws between the 95th percentile and the slowest step, spread evenly: with
a few dozen prompt steps, one outlier 4x the fit then stretched one prompt in forty, and the
simulated multi-turn TTFT p99 came out 1.6-2.1x the real one.)"""


def step_ratio_quantiles(
    cost: StepCost, records: Sequence[StepRecord], computes_prompt: bool = False
) -> tuple[float, ...]:
    """``RATIO_QUANTILES`` evenly spaced quantiles of each record's seconds over ``cost``'s
    prediction for it, over the decode-only records (those computing prompt tokens with
    ``computes_prompt``; records it cannot predict left out; empty with fewer than two)."""
    ratios = sorted(
        record.seconds / predicted
        for record in records
        if (record.shape.prefill_tokens > 0) == computes_prompt
        and cost.predicts(record.shape)
        and (predicted := cost.step_s(record.shape)) > 0
    )
    if len(ratios) < 2:
        return ()
    inner = statistics.quantiles(ratios, n=RATIO_QUANTILES - 1, method="inclusive")
    return tuple(round(ratio, 4) for ratio in (ratios[0], *inner, ratios[-1]))


def held_out_mape(records: Sequence[StepRecord]) -> float:
    """The model's error on steps it was not fitted on: fitted on the even-numbered records,
    measured on the odd-numbered ones. ValueError when either half lacks steps of a kind."""
    fitted, held_out = records[0::2], records[1::2]
    cost = fit_step_cost(fitted)
    if not (cost.knows_decode and cost.knows_prefill):
        raise ValueError(f"need at least {MIN_STEPS} decode and prefill steps in each half")
    return mape(cost, held_out)
