"""The size check of a transfer's messages: a random canary per message (one layer, or a
group of layers: ``plan.py``; "layer" below is the message's index), armed and read back
without a synchronous device round trip per message.

Why: UCX completes a tag receive with a *shorter* message as a success and ucxx reports no
received length (``ucx.py``, Sizes); only a longer message fails its receive. So the receiver
writes a canary into the last ``CANARY_BYTES`` bytes of the buffer a layer's message is
received into before it posts the receive (``arm``), and copies those bytes out once the
receive completed (``read``). A message that filled the buffer overwrote them; one that stopped
at least ``CANARY_BYTES`` bytes short of the buffer's end, an empty one included, left them, and
``short`` says so.

Canaries: ``CANARY_BYTES`` bytes per layer, drawn for each transfer from the operating system's
CSPRNG (``secrets``) and never sent, so uniformly random and unknown to the sender. A
legitimate message whose last 8 bytes happen to equal its canary is called short, with
probability 2**-64. A holder of the transfer secret can do no more with this than send any
bytes at the planned size, which it can anyway.

Cost: the canaries of every layer go to the device once, with the receiver (one host-to-device
copy of ``[layers, 8]`` bytes). On CUDA, ``arm`` queues an 8-byte device-to-device copy and
``read`` an 8-byte device-to-host copy into pinned memory, both on the current stream (the
receiver's transfer stream) and neither waiting: the receiver orders them with the fences it
waits for anyway (``device_order.py``: before posting a receive into an armed buffer, after the
scatter of a received layer), and calls ``short`` only after the fence that follows ``read``.
On the CPU they are 8-byte memory copies through numpy views (about a microsecond each).

Limits: a message 1 to ``CANARY_BYTES - 1`` bytes short overwrites part of the canary and
passes (its last bytes then hold canary bytes): without a received length, a check of content
cannot tell it from a full message at better odds than 2**-8 per unwritten byte. A sender that
cuts the KV otherwise than planned (a bug, a version skew) is off by whole blocks, far more. A
buffer shorter than ``CANARY_BYTES`` takes a canary of its size (2**-8 per byte of spurious
failure; plans never make one, a message being K and V of whole blocks); an empty one has
nothing to check and is never short. An armed buffer's last bytes hold the canary until a
message overwrites them.
"""

from __future__ import annotations

import secrets

import torch

CANARY_BYTES = 8


class LayerCanaries:
    """One transfer's canaries: one per layer, for buffers of ``message_bytes`` on ``device``.

    Thread contract: the receiver's event loop only. ``arm`` before the receive of that layer
    is posted (and after the fence that orders it); ``read`` after it completed; ``short`` after
    the fence that follows ``read``.
    """

    def __init__(self, num_layers: int, message_bytes: int, device: torch.device) -> None:
        self.size = min(CANARY_BYTES, message_bytes)
        """Bytes a canary covers: ``CANARY_BYTES``, or all of a shorter buffer."""
        self._values = secrets.token_bytes(num_layers * self.size)
        table = torch.frombuffer(bytearray(self._values) or bytearray(1), dtype=torch.uint8)
        host = table[: num_layers * self.size].view(num_layers, self.size)  # [layers, size]
        self._cuda = device.type == "cuda"
        # pinned and queued, not a pageable copy that waits for the device (the receiver makes
        # these on its event loop; its transfer stream follows this stream)
        self._table = host.pin_memory().to(device, non_blocking=True) if self._cuda else host
        self._seen = torch.empty(  # [layers, size]: what each buffer's tail held when read
            (num_layers, self.size), dtype=torch.uint8, pin_memory=self._cuda
        )

    def arm(self, layer: int, buffer: torch.Tensor) -> None:
        """Write ``layer``'s canary into the last bytes of ``buffer`` (uint8, contiguous, of
        the planned message size); on CUDA queued on the current stream."""
        if self.size == 0:
            return
        if self._cuda:
            buffer[-self.size :].copy_(self._table[layer], non_blocking=True)
        else:
            buffer.numpy()[-self.size :] = self._table[layer].numpy()

    def read(self, layer: int, buffer: torch.Tensor) -> None:
        """Copy out the last bytes of ``buffer``, into which ``layer``'s message was received;
        on CUDA queued on the current stream, into pinned host memory."""
        if self.size == 0:
            return
        if self._cuda:
            self._seen[layer].copy_(buffer[-self.size :], non_blocking=True)
        else:
            self._seen[layer].numpy()[:] = buffer.numpy()[-self.size :]

    def short(self, layer: int) -> bool:
        """Whether ``layer``'s message left the canary whole: it stopped at least ``size``
        bytes short of its buffer's end (never for an empty buffer)."""
        if self.size == 0:
            return False
        canary = self._values[layer * self.size : (layer + 1) * self.size]
        return self._seen[layer].numpy().tobytes() == canary
