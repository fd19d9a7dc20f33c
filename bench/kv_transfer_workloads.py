"""What ``bench_kv_transfer.py`` moves, and over which UCX settings: the workloads (a model's
KV of a prompt, into consecutive or fragmented blocks, or one big "layer"; the default model's
on cpu, Llama-3-8B's on cuda) and the UCX configurations of each device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.transfer.destination import min_message_bytes
from splitserve.transfer.plan import TransferPlan, group_layers
from splitserve.transfer.ucx_settings import UcxSettings

BLOCK_SIZE = 16
FRAGMENTED_RUNS = 4
SPARE_BLOCKS = 16
"""Blocks of the receiver's cache after the reserved ones (other requests' blocks): a decode
worker's reservation is never all of its cache, so every workload is received as in
production (through the receiver's staging ring, never straight into the cache)."""

SMOLLM2_LAYERS = 30
SMOLLM2_HALF_BLOCK_BYTES = 16 * 3 * 64 * 2
"""K (or V) bytes of one block of the default model in bf16: block_size x kv_heads x dim x 2."""
PROMPT_TOKENS = (128, 1024, 4096)
BIG_MESSAGE_BYTES = 64 << 20

LLAMA8B_LAYERS = 32
LLAMA8B_HALF_BLOCK_BYTES = 16 * 8 * 128 * 2
"""K (or V) bytes of one Llama-3-8B block in bf16: 32 KiB."""
GPU_PROMPT_TOKENS = (1024, 8192)
GPU_BIG_MESSAGE_BYTES = 256 << 20
"""One message of the cuda mode's big "layer" (it has a K and a V message of this size)."""


@dataclass(frozen=True)
class Workload:
    """One transfer of ``num_layers`` layers into ``block_ids`` of a cache of ``uint8
    [num_layers, 2, cache_blocks, half_block_bytes]``, in messages of at least
    ``min_message_bytes`` (``KvDestination``: 0, one layer a message)."""

    name: str
    num_layers: int
    half_block_bytes: int
    block_ids: tuple[int, ...]
    min_message_bytes: int = 0

    @property
    def cache_blocks(self) -> int:
        return max(self.block_ids) + 1 + SPARE_BLOCKS

    @property
    def layer_bytes(self) -> int:
        return 2 * len(self.block_ids) * self.half_block_bytes

    @property
    def num_messages(self) -> int:
        return self.plan.messages_for(self.num_layers)

    @property
    def message_bytes(self) -> int:
        return self.plan.layers_per_message * self.layer_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def plan(self) -> TransferPlan:
        """The plan the receiver's ``KvDestination(cache, block_ids, min_message_bytes)``
        makes (the bench's sender takes it from here, as a worker from the reservation)."""
        group = group_layers(self.num_layers, self.layer_bytes, self.min_message_bytes)
        return TransferPlan.for_destination(self.block_ids, group)

    @property
    def source_shape(self) -> tuple[int, int, int, int]:
        """The sender's KV of the prompt: ``[layers, 2, blocks, half_block_bytes]``."""
        return (self.num_layers, 2, len(self.block_ids), self.half_block_bytes)


def fragmented(num_blocks: int, runs: int) -> tuple[int, ...]:
    """``num_blocks`` ids in ``runs`` runs with a free block between runs, last run first."""
    per_run = -(-num_blocks // runs)
    starts = [run * (per_run + 1) for run in range(runs)]
    chunks = [
        list(range(start, start + min(per_run, num_blocks - run * per_run)))
        for run, start in enumerate(starts)
    ]
    return tuple(block for chunk in reversed(chunks) for block in chunk)


def prompt_workloads(
    num_layers: int,
    half_block_bytes: int,
    prompt_tokens: Sequence[int],
    group_bytes: int,
    variant_bytes: int,
    variant: str,
) -> list[Workload]:
    """A model's KV of each prompt length, into consecutive blocks, in messages of at least
    ``group_bytes`` (what the device's workers send); the 1024-token one also in
    ``FRAGMENTED_RUNS`` runs, and both of those also in messages of at least ``variant_bytes``
    (named with ``-variant``)."""
    work = []
    for tokens in prompt_tokens:
        blocks = -(-tokens // BLOCK_SIZE)
        layouts = [(f"prompt-{tokens}", tuple(range(blocks)))]
        if tokens == 1024:
            layouts.append(
                (f"prompt-{tokens}-{FRAGMENTED_RUNS}runs", fragmented(blocks, FRAGMENTED_RUNS))
            )
        for name, block_ids in layouts:
            work.append(Workload(name, num_layers, half_block_bytes, block_ids, group_bytes))
            if tokens in (128, 1024):
                work.append(
                    Workload(
                        f"{name}-{variant}", num_layers, half_block_bytes, block_ids, variant_bytes
                    )
                )
    return work


def workloads(device: str = "cpu") -> list[Workload]:
    """In the groups of layers the device's workers send (``destination.MIN_MESSAGE_BYTES``),
    the 128- and 1024-token prompts (and the fragmented one) also one layer a message
    (``-per-layer``, the format before groups), in the same run. cpu: the default model's KV
    of each prompt length (1 MiB groups: 15 layers a message for 128 tokens, 2 for 1,024), a
    fragmented one, and 64 MiB; cuda: Llama-3-8B's KV of a 1024 and an 8192 token prompt (16 MiB
    groups: 8 messages of 4 layers for 1,024 tokens, one layer a message for 8,192), a
    fragmented one, and 2 x 256 MiB."""
    group = min_message_bytes(torch.device(device))
    if device == "cuda":
        work = prompt_workloads(
            LLAMA8B_LAYERS, LLAMA8B_HALF_BLOCK_BYTES, GPU_PROMPT_TOKENS, group, 0, "per-layer"
        )
        return [*work, Workload("layer-2x256MiB", 1, GPU_BIG_MESSAGE_BYTES, (0,))]
    work = prompt_workloads(
        SMOLLM2_LAYERS, SMOLLM2_HALF_BLOCK_BYTES, PROMPT_TOKENS, group, 0, "per-layer"
    )
    return [*work, Workload("message-64MiB", 1, BIG_MESSAGE_BYTES // 2, (0,))]


@dataclass(frozen=True)
class UcxConfig:
    name: str
    settings: UcxSettings


def ucx_configs(skip_tcp: bool, device: str = "cpu") -> list[UcxConfig]:
    if device == "cuda":
        configs = [
            UcxConfig("ucx default tls", UcxSettings()),
            UcxConfig(
                "ucx tls=cuda_ipc,cuda_copy,sm,self",
                UcxSettings(tls="cuda_ipc,cuda_copy,sm,self"),
            ),
            UcxConfig(
                "ucx default tls, progress thread-polling",
                UcxSettings(progress_mode="thread-polling"),
            ),
        ]
        if not skip_tcp:
            configs.append(UcxConfig("ucx tls=cuda_copy,tcp", UcxSettings(tls="cuda_copy,tcp")))
        return configs
    configs = [
        UcxConfig("ucx error_handling=off", UcxSettings()),
        UcxConfig("ucx error_handling=on", UcxSettings(error_handling=True)),
        UcxConfig("ucx progress thread-polling", UcxSettings(progress_mode="thread-polling")),
    ]
    if not skip_tcp:
        configs.append(UcxConfig("ucx tls=tcp", UcxSettings(tls="tcp")))
    return configs
