"""LoRA adapters in PEFT's saved format, applied per request within a mixed batch.

A LoRA adapter adds a low-rank term to some of the decoder's projections: for a target
projection ``W`` ``[out, in]`` with factors ``A`` ``[rank, in]`` and ``B`` ``[out, rank]``,
``y = x @ W.T + scaling * ((x @ A.T) @ B.T)``, where ``scaling = lora_alpha / rank``
(``lora_alpha / sqrt(rank)`` with ``use_rslora``). This is PEFT's unmerged forward (computed
in another grouping, ``AdapterBank``), so a request served with an adapter gets the tokens
that HF ``transformers`` with PEFT computes on the same base weights (float32 greedy, tested).

Contract:
- ``load_lora_adapter`` reads a folder as ``PeftModel.save_pretrained`` writes it
  (``adapter_config.json``, ``adapter_model.safetensors``) whose targets are among the
  decoder layers' seven projections (q, k, v, o, gate, up, down). Anything whose forward is
  not the plain term above is refused with ``ModelLoadError`` naming it (DoRA, LoRA biases,
  ``modules_to_save``, embedding or LM-head targets, ``alpha_pattern``, ``fan_in_fan_out``,
  a pickled ``adapter_model.bin``, shapes that do not fit the model): a request is never
  served with an adapter that computes something else than the user trained.
- The model keeps its base weights; each adapter's factors are held apart, in the model's
  dtype, on its device. A step's rows take their own request's adapter or none
  (``StepAdapters``): requests of several adapters and of the base model share one step.
- Two layouts of the loaded factors (``adapter_layout``): up to ``BANK_MAX_ADAPTERS``
  loaded, every adapter side by side (``AdapterBank``: two products a projection, whatever
  adapters the step takes); beyond, each adapter apart (``AdapterGroups``: a step multiplies
  each row only by its own adapter's factors), so that many loaded adapters cost a step only
  those its rows take.
- A row's term depends only on its own input row and the adapters loaded, where the base
  projections' rows do (``engine/linear.py``: float32 on the CPU, its rows padded alike; bf16
  where oneDNN's sums do not change with the row count, not on AMX for calls of fewer than
  about 37 rows): every step's products have the bank's widths (``AdapterBank``), whatever
  adapters the step's rows take.
- ``digest``: a hash of the adapter's two files. Workers announce their adapters by name and
  digest; a coordinator routes a request of an adapter only to workers that hold that name
  with one digest, since the prompt's KV computed by one worker is decoded by another.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.common.errors import ModelLoadError
from splitserve.engine.linear import Linear
from splitserve.engine.model_config import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

BANK_MAX_ADAPTERS = 8
"""The most adapters laid side by side (``AdapterBank``); more loaded: ``AdapterGroups``.
Measured on the AMX Xeon (6/207), batch 8, bf16, one core, ratio of a step to the base
step's (``bench/bench_lora.py --loaded N --bank-max M``): the bank costs the same whatever
the step takes and grows with the adapters loaded (4: 1.13x; 8: 1.48x; 16: 1.7-2.5x across
runs); apart, a step costs about 0.2-0.3x more per distinct adapter its rows take, whatever
is loaded (16 loaded: 1.15x for one, 2.24x for four). Past 8 loaded the bank's cost has no
bound but the loaded count; apart it is bounded by the step's own adapters."""
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
"""The model's (fused) projections, as ``engine/model.py:DecoderLayerWeights`` names them."""
_TARGET_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)
_REFUSED_SETTINGS = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "alpha_pattern": "per-module alpha (alpha_pattern)",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "layer_replication": "layer_replication",
    "layers_to_transform": "layers_to_transform",
}


@dataclass(frozen=True)
class LoraPart:
    """One target projection's share of its (fused) projection's adapter term."""

    ranks: slice
    """Its rows in the projection's stacked ``a`` (its rank's)."""
    b: torch.Tensor  # [part_out, rank]
    scaling: float
    columns: slice
    """Where the target's outputs lie in the fused projection's ``[tokens, out]``."""


@dataclass(frozen=True)
class LoraProjection:
    """An adapter's factors on one (fused) projection: the targets' A stacked, so a step
    multiplies its rows by them once, then each target's B."""

    a: torch.Tensor  # [sum of the targets' ranks, in]
    parts: tuple[LoraPart, ...]


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: per decoder layer, per fused projection, its factors."""

    name: str
    digest: str
    layers: tuple[Mapping[str, LoraProjection], ...]
    """``layers[i][projection]``: what adds to layer ``i``'s ``projection``
    (``PROJECTIONS``); a projection the adapter does not target is absent."""


def _target_columns(config: ModelArchConfig) -> dict[str, tuple[str, slice]]:
    """Each target projection's fused projection and its output columns there."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": ("qkv", slice(0, q)),
        "k_proj": ("qkv", slice(q, q + kv)),
        "v_proj": ("qkv", slice(q + kv, q + 2 * kv)),
        "o_proj": ("o_proj", slice(0, config.hidden_size)),
        "gate_proj": ("gate_up", slice(0, inter)),
        "up_proj": ("gate_up", slice(inter, 2 * inter)),
        "down_proj": ("down", slice(0, config.hidden_size)),
    }


def _in_features(config: ModelArchConfig, target: str) -> int:
    """The input width of a target projection."""
    if target == "o_proj":
        return config.q_size
    if target == "down_proj":
        return config.intermediate_size
    return config.hidden_size


def adapter_digest(path: Path) -> str:
    """A hash of the adapter folder's config and weights (hex, 32 characters)."""
    digest = hashlib.blake2b(b"splitserve-lora", digest_size=16)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update(name.encode())
        with open(path / name, "rb") as file:
            for piece in iter(lambda: file.read(1 << 20), b""):
                digest.update(piece)
    return digest.hexdigest()


def read_adapter_config(path: Path) -> dict[str, object]:
    """The adapter's ``adapter_config.json``, checked to describe a plain LoRA adapter whose
    files are here; ``ModelLoadError`` otherwise."""
    if not (path / CONFIG_FILE).is_file():
        raise ModelLoadError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
    if not (path / WEIGHTS_FILE).is_file():
        raise ModelLoadError(
            f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILE} (a pickled adapter_model.bin "
            "is not read: save it with safe_serialization=True)"
        )
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"LoRA adapter {str(path)!r}: unreadable {CONFIG_FILE}: {error}"
        ) from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not an object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ModelLoadError(f"LoRA adapter {str(path)!r} is a {peft_type} adapter, not LoRA")
    for key, what in _REFUSED_SETTINGS.items():
        if config.get(key):
            raise ModelLoadError(f"LoRA adapter {str(path)!r} uses {what}, which is not served")
    if config.get("bias", "none") != "none":
        raise ModelLoadError(f"LoRA adapter {str(path)!r} trains biases, which is not served")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ModelLoadError(f"LoRA adapter {str(path)!r}: lora_alpha must be a number")
    return config


def check_rank(path: Path, rank: int, max_rank: int) -> None:
    """``ModelLoadError`` where ``rank`` exceeds ``max_rank`` (0: any rank)."""
    if max_rank and rank > max_rank:
        raise ModelLoadError(
            f"LoRA adapter {str(path)!r} has rank {rank}, above this worker's --max-lora-rank "
            f"({max_rank})"
        )


def config_rank(settings: dict[str, object]) -> int:
    """The largest rank an adapter's config declares (``r``, ``rank_pattern``'s values)."""
    ranks = [settings.get("r", 0)]
    pattern = settings.get("rank_pattern")
    if isinstance(pattern, dict):
        ranks.extend(pattern.values())
    return max((r for r in ranks if isinstance(r, int) and not isinstance(r, bool)), default=0)


def load_lora_adapter(
    name: str,
    path: str | Path,
    config: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int = 0,
) -> LoraAdapter:
    """The adapter saved in folder ``path``, for a model of ``config``, its factors in
    ``dtype`` on ``device``, served as ``name`` (see the module docstring for what is
    refused; ``max_rank``: a factor of a larger rank is refused too, 0: any)."""
    from safetensors.torch import load_file

    folder = Path(path)
    settings = read_adapter_config(folder)
    alpha = float(settings["lora_alpha"])  # type: ignore[arg-type]
    rslora = bool(settings.get("use_rslora", False))
    tensors = load_file(str(folder / WEIGHTS_FILE))
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TARGET_KEY.search(key)
        if match is None:
            raise ModelLoadError(
                f"LoRA adapter {str(folder)!r}: tensor {key!r} is not a decoder projection's "
                "lora_A/lora_B (only q, k, v, o, gate, up and down projections are served)"
            )
        layer, target, which = int(match[1]), match[2], match[3]
        if layer >= config.num_hidden_layers:
            raise ModelLoadError(
                f"LoRA adapter {str(folder)!r}: {key!r} names layer {layer}; the model has "
                f"{config.num_hidden_layers}"
            )
        factors.setdefault((layer, target), {})[which] = tensor
    if not factors:
        raise ModelLoadError(f"LoRA adapter {str(folder)!r} holds no LoRA factors")
    columns = _target_columns(config)
    stacked: list[dict[str, list[tuple[torch.Tensor, LoraPart]]]] = [
        {} for _ in range(config.num_hidden_layers)
    ]
    for (layer, target), pair in sorted(factors.items()):
        a, b = pair.get("A"), pair.get("B")
        projection, where = columns[target]
        if a is None or b is None:
            raise ModelLoadError(
                f"LoRA adapter {str(folder)!r}: layer {layer}'s {target} lacks lora_A or lora_B"
            )
        rank = a.shape[0]
        check_rank(folder, rank, max_rank)
        expected_a = (rank, _in_features(config, target))
        expected_b = (where.stop - where.start, rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b or rank == 0:
            raise ModelLoadError(
                f"LoRA adapter {str(folder)!r}: layer {layer}'s {target} has factors "
                f"{tuple(a.shape)} and {tuple(b.shape)}; this model needs {expected_a} and "
                f"{expected_b} (an adapter of another model?)"
            )
        parts = stacked[layer].setdefault(projection, [])
        first = sum(part.ranks.stop - part.ranks.start for _, part in parts)
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        b_factor = b.to(device=device, dtype=dtype).contiguous()
        parts.append((a, LoraPart(slice(first, first + rank), b_factor, scaling, where)))
    layers = tuple(
        {
            projection: LoraProjection(
                a=torch.cat([a for a, _ in parts]).to(device=device, dtype=dtype).contiguous(),
                parts=tuple(part for _, part in parts),
            )
            for projection, parts in layer.items()
        }
        for layer in stacked
    )
    return LoraAdapter(name=name, digest=adapter_digest(folder), layers=layers)


@dataclass(frozen=True)
class _BankedProjection:
    """Every loaded adapter's factors on one projection of one layer, side by side, as
    ``engine/linear.py:Linear`` products (prepacked for oneDNN in bf16 on the CPU; float32
    rows padded as the base projections' are, so a row's bits do not depend on its step)."""

    a: Linear  # in -> adapters * width: adapter k's stacked A in rows k * width on
    b: Linear  # adapters * width -> out: adapter k's B, times its scaling, under those


class AdapterBank:
    """The loaded adapters' factors laid side by side per projection, so that a step's rows,
    whatever adapters they take, cost each projection two products: ``x`` by every adapter's
    A at once, the columns of other adapters than the row's zeroed (``StepAdapters``), then
    by every adapter's B. Adapter ``k`` of ``names`` owns columns ``k * width`` on (a
    projection's ``width``: its largest stacked rank over adapters and layers; zero-padded).

    Adapters are banked by digest (``LoraAdapter.digest``; one slot per distinct files,
    however many names serve them): a step's rows name theirs by digest. A row's term is
    computed over the same columns whatever adapters share its step (the products' widths
    depend on the adapters banked, not on the step), and a row of the base model gets exact
    zeros. Against PEFT's unmerged ``(x @ A.T @ B.T) * scaling`` per target,
    the scaling is folded into B and the products run over the zero-padded columns: the same
    terms summed in another grouping (float32 greedy output equal to PEFT's, tested)."""

    def __init__(self, adapters: Sequence[LoraAdapter], num_layers: int) -> None:
        self.digests = tuple(adapter.digest for adapter in adapters)
        self.slot = {digest: index for index, digest in enumerate(self.digests)}
        widths: dict[str, int] = {}
        for adapter in adapters:
            for layer in adapter.layers:
                for projection, factors in layer.items():
                    widths[projection] = max(widths.get(projection, 0), factors.a.shape[0])
        self.widths = widths
        self.dtype = next(
            factors.a.dtype
            for adapter in adapters
            for layer in adapter.layers
            for factors in layer.values()
        )
        """The model's dtype, the factors' (at least one adapter is banked)."""
        self.layers: list[dict[str, _BankedProjection]] = [
            {projection: self._bank(adapters, layer, projection, width)
             for projection, width in widths.items()}
            for layer in range(num_layers)
        ]  # fmt: skip

    @staticmethod
    def _bank(
        adapters: Sequence[LoraAdapter], layer: int, projection: str, width: int
    ) -> _BankedProjection:
        """One projection of one layer: each adapter's stacked A and scaled, block-placed B
        (zeros where the adapter does not target it)."""
        some = next(a.layers[layer][projection] for a in adapters if projection in a.layers[layer])
        in_features, dtype, device = some.a.shape[1], some.a.dtype, some.a.device
        out_features = max(part.columns.stop for part in some.parts)
        a = torch.zeros(len(adapters) * width, in_features, dtype=dtype, device=device)
        b = torch.zeros(out_features, len(adapters) * width, dtype=torch.float32, device=device)
        for index, adapter in enumerate(adapters):
            factors = adapter.layers[layer].get(projection)
            if factors is None:
                continue
            first = index * width
            a[first : first + factors.a.shape[0]] = factors.a
            for part in factors.parts:
                ranks = slice(first + part.ranks.start, first + part.ranks.stop)
                b[part.columns, ranks] = part.b.float() * part.scaling
        return _BankedProjection(
            a=Linear(a, decode_gemv=False), b=Linear(b.to(dtype), decode_gemv=False)
        )

    def step(self, row_adapters: Sequence[str], device: torch.device) -> StepAdapters | None:
        """The step whose row ``i`` takes the adapter of digest ``row_adapters[i]`` ("" for
        none); None when no row takes one."""
        if not any(row_adapters):
            return None
        dtype = self.dtype
        owner = torch.zeros(len(row_adapters), len(self.digests), dtype=dtype)  # [rows, adapters]
        for row, digest in enumerate(row_adapters):
            if digest:
                owner[row, self.slot[digest]] = 1
        by_width = {
            width: owner.repeat_interleave(width, dim=1).to(device)  # [rows, adapters * width]
            for width in set(self.widths.values())
        }
        masks = {projection: by_width[width] for projection, width in self.widths.items()}
        return StepAdapters(self, masks)


@dataclass(frozen=True)
class StepAdapters:
    """Which rows of a packed step take which adapter: per projection, a mask of the bank's
    columns each row keeps (its adapter's; none for a row of the base model)."""

    bank: AdapterBank
    masks: Mapping[str, torch.Tensor]  # projection -> [tokens, adapters * width]

    def add_to(
        self,
        out: torch.Tensor,  # [tokens, out]: the base projection of ``x``, updated in place
        x: torch.Tensor,  # [tokens, in]
        layer: int,
        projection: str,
    ) -> torch.Tensor:
        """``out`` with each row's adapter's term of ``projection`` in decoder layer ``layer``
        added (``AdapterBank``)."""
        banked = self.bank.layers[layer].get(projection)
        if banked is None:
            return out
        low = banked.a(x) * self.masks[projection]  # [tokens, adapters * width]
        out += banked.b(low)
        return out


class AdapterGroups:
    """The loaded adapters' factors each apart, per projection: a step's rows are grouped by
    adapter, and each group multiplied by its own adapter's A then scaled B (four ops a
    projection per adapter the step takes: gather, two products, scatter-add; none for an
    adapter no row takes). The cost follows the adapters in the step, not those loaded.

    Each adapter's products have its own widths (its stacked rank per projection), whatever
    else is loaded or in the step, through ``engine/linear.py:Linear`` as the bank's are; a
    row's term is PEFT's, in the bank's grouping (float32 greedy output equal to PEFT's,
    tested). Rows of the base model get nothing added."""

    def __init__(
        self,
        adapters: Sequence[LoraAdapter],
        num_layers: int,
        previous: AdapterGroups | None = None,
    ) -> None:
        """``previous``: the layout these adapters replace; the products of the adapters it
        holds are taken from it as they are (prepacking every adapter's again held the
        engine thread 0.7-0.9 s a runtime load with 9-12 loaded, AMX Xeon 6/207, one
        core), so a load prepacks only the new adapter's."""
        self.digests = tuple(adapter.digest for adapter in adapters)
        self.slot = {digest: index for index, digest in enumerate(self.digests)}

        def products(adapter: LoraAdapter, layer: int, projection: str) -> _BankedProjection | None:
            if previous is not None and adapter.digest in previous.slot:
                return previous.layers[layer][projection][previous.slot[adapter.digest]]
            return _apart(adapter, layer, projection)

        self.layers: list[dict[str, tuple[_BankedProjection | None, ...]]] = [
            {
                projection: tuple(products(adapter, layer, projection) for adapter in adapters)
                for projection in PROJECTIONS
            }
            for layer in range(num_layers)
        ]

    def step(self, row_adapters: Sequence[str], device: torch.device) -> StepGroups | None:
        """The step whose row ``i`` takes the adapter of digest ``row_adapters[i]`` ("" for
        none); None when no row takes one."""
        rows: dict[int, list[int]] = {}
        for row, digest in enumerate(row_adapters):
            if digest:
                rows.setdefault(self.slot[digest], []).append(row)
        if not rows:
            return None
        everyone = len(row_adapters)
        return StepGroups(
            self,
            {
                slot: None if len(taken) == everyone else torch.tensor(taken, device=device)
                for slot, taken in rows.items()
            },
        )


def _apart(adapter: LoraAdapter, layer: int, projection: str) -> _BankedProjection | None:
    """One adapter's factors on one projection of one layer, at its own width (None where it
    does not target the projection)."""
    factors = adapter.layers[layer].get(projection)
    if factors is None:
        return None
    return AdapterBank._bank([adapter], layer, projection, factors.a.shape[0])


@dataclass(frozen=True)
class StepGroups:
    """Which rows of a packed step take which adapter, by the adapter's slot in
    ``AdapterGroups``: their row indices (None: every row of the step)."""

    groups: AdapterGroups
    rows: Mapping[int, torch.Tensor | None]  # slot -> [rows taking it] or None

    def add_to(
        self,
        out: torch.Tensor,  # [tokens, out]: the base projection of ``x``, updated in place
        x: torch.Tensor,  # [tokens, in]
        layer: int,
        projection: str,
    ) -> torch.Tensor:
        """``out`` with each row's adapter's term of ``projection`` in decoder layer ``layer``
        added (``AdapterGroups``)."""
        factors = self.groups.layers[layer][projection]
        for slot, rows in self.rows.items():
            own = factors[slot]
            if own is None:
                continue
            if rows is None:
                out += own.b(own.a(x))
            else:
                out.index_add_(0, rows, own.b(own.a(x.index_select(0, rows))))
        return out


AdapterLayout = AdapterBank | AdapterGroups
"""How the loaded adapters' factors are laid out for steps (``adapter_layout``)."""
StepTerms = StepAdapters | StepGroups
"""A step's adapters, as its layout hands them to ``engine/model.py``'s layers."""


@dataclass(frozen=True)
class PreparedLayout:
    """A layout built ahead for the adapters of ``digests``, in the engine's banking order
    (``EngineCore.prepare_layout``)."""

    digests: tuple[str, ...]
    layout: AdapterLayout | None


def adapter_layout(
    adapters: Sequence[LoraAdapter], num_layers: int, previous: AdapterLayout | None = None
) -> AdapterLayout | None:
    """The layout of ``adapters`` (one per digest) for a model of ``num_layers`` layers: the
    bank up to ``BANK_MAX_ADAPTERS`` of them (read when called), else each apart (reusing
    ``previous``'s products where it lays them apart too); None for none. Which one depends
    only on what is loaded, so a row's term never depends on what shares its step."""
    if not adapters:
        return None
    if len(adapters) <= BANK_MAX_ADAPTERS:
        return AdapterBank(adapters, num_layers)
    return AdapterGroups(
        adapters, num_layers, previous if isinstance(previous, AdapterGroups) else None
    )
