"""The receiving process of ``bench_kv_transfer.py`` (the decode side: a child started with
multiprocessing "spawn", receiving every transfer into the reserved blocks of a KV cache with
``LayerReceiver``, as the decode worker does), and what the two processes share: the control
pipe and its bounds, the system-wide clock both read, the byte check (CRC32), and the CUDA
context UCX needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
from kv_transfer_workloads import UcxConfig, Workload

from splitserve.engine.host_memory import zeros_huge_pages
from splitserve.transfer.destination import KvDestination
from splitserve.transfer.layer_channel import LayerReceiver
from splitserve.transfer.ucx import UcxTransport

CONTROL_TIMEOUT_S = 60.0
"""Bound on every wait for the other process (a crashed child fails the bench, never hangs)."""
CUDA_DEVICE_INDEX = 0
CHECK_CHUNK_BYTES = 16 << 20
"""cuda mode's byte check: one CRC32 per chunk of this many bytes."""
CHILD_FAILED = "receiver failed"
"""First item of the tuple a failing child sends before it exits (with the error's text)."""


@dataclass(frozen=True)
class ChildOptions:
    """What the receiver child needs besides its UCX configuration."""

    device: str
    threads: int
    transfer_timeout_s: float


def monotonic() -> float:
    """The system-wide monotonic clock, comparable between processes of this machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.numpy().data)


@functools.cache
def _crc_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="crc")


def chunk_crc32(host: torch.Tensor) -> tuple[int, ...]:
    """CRC32 of each ``CHECK_CHUNK_BYTES`` chunk of a contiguous host uint8 tensor's bytes, on
    a few threads (zlib releases the GIL)."""
    flat = host.reshape(-1).numpy()
    chunks = [flat[i : i + CHECK_CHUNK_BYTES] for i in range(0, flat.size, CHECK_CHUNK_BYTES)]
    return tuple(_crc_pool().map(zlib.crc32, chunks))


def init_cuda() -> None:
    """Make the primary CUDA context of GPU ``CUDA_DEVICE_INDEX`` current in this thread (UCX's
    CUDA transports need one when ``ucxx.init`` creates the worker): idempotent."""
    torch.cuda.init()
    torch.cuda.set_device(CUDA_DEVICE_INDEX)
    torch.empty(1, device="cuda").zero_()  # the first allocation creates the context
    torch.cuda.synchronize()


def synchronize(device: str) -> None:
    """Wait for this process's pending CUDA work (UCX is not stream-ordered); no-op on cpu."""
    if device == "cuda":
        torch.cuda.synchronize()


def recv_within(conn: Connection, timeout_s: float = CONTROL_TIMEOUT_S) -> object:
    """The next control message from the other process; ``TimeoutError`` if none comes,
    ``RuntimeError`` with its text if the child reports its failure, ``EOFError`` if it is
    gone."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no control message within {timeout_s:.0f}s")
    try:
        message = conn.recv()
    except EOFError:
        raise EOFError("the other process closed its pipe (it exited or died)") from None
    if isinstance(message, tuple) and len(message) == 2 and message[0] == CHILD_FAILED:
        raise RuntimeError(f"{CHILD_FAILED}: {message[1]}")
    return message


# ----------------------------------------------------------------------------- receiver (child)


def receiver_main(conn: Connection, config: UcxConfig, options: ChildOptions) -> None:
    """Child process entry: the decode side, serving transfers until told to stop. A failure
    is sent to the parent (its text) before the child exits."""
    torch.set_num_threads(options.threads)
    try:
        if options.device == "cuda":
            init_cuda()  # before ucxx.init
        asyncio.run(_serve_receives(conn, config, options))
    except BaseException as error:
        with contextlib.suppress(Exception):  # the parent may be gone already
            conn.send((CHILD_FAILED, f"{type(error).__name__}: {error}"))
        raise
    finally:
        conn.close()


async def _serve_receives(conn: Connection, config: UcxConfig, options: ChildOptions) -> None:
    transport = UcxTransport(config.settings)
    caches: dict[Workload, torch.Tensor] = {}
    host_copies: dict[Workload, torch.Tensor] = {}  # cuda: pinned room for the byte check
    conn.send(transport.address)
    try:
        while isinstance(command := await asyncio.to_thread(recv_within, conn), tuple):
            workload, transfer_id, secret = command
            cache = caches.get(workload)
            if cache is None:  # [layers, 2, blocks, half_block_bytes], allocated as a KV cache
                shape = (workload.num_layers, 2, workload.cache_blocks, workload.half_block_bytes)
                cache = zeros_huge_pages(shape, torch.uint8, options.device)
                caches[workload] = cache
            cache.zero_()
            synchronize(options.device)  # zeroed before any message may land
            destination = KvDestination(cache, workload.block_ids, workload.min_message_bytes)
            receiver = LayerReceiver(transport, transfer_id, secret, destination)
            await asyncio.sleep(0.005)  # let the receiver post its receives
            conn.send("ready")
            await receiver.wait(options.transfer_timeout_s)
            conn.send(monotonic())
            if options.device == "cuda":
                conn.send(_device_checksum(cache, workload, host_copies))
            else:
                conn.send(crc32(cache[:, :, list(workload.block_ids)].contiguous()))
    finally:
        await transport.close()


def _device_checksum(
    cache: torch.Tensor, workload: Workload, host_copies: dict[Workload, torch.Tensor]
) -> tuple[int, ...]:
    """``chunk_crc32`` of the reserved blocks of a CUDA cache, gathered in block-table order on
    the GPU and copied to host memory (pinned where it can be had, kept per workload)."""
    index = torch.tensor(workload.block_ids, device=cache.device)
    gathered = cache.index_select(2, index)
    host = host_copies.get(workload)
    if host is None:
        try:
            host = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: pageable is slower, as exact
            host = torch.empty(gathered.shape, dtype=torch.uint8)
        host_copies[workload] = host
    host.copy_(gathered)  # synchronous
    return chunk_crc32(host)
