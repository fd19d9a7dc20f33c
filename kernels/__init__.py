"""splitserve.kernels: Triton kernels, each with an input-checking wrapper and a torch reference.

- ``decode_attention``: paged decode attention (GQA-grouped, split-K flash-decoding);
- ``prefill_attention``: causal attention of packed variable-length chunks over the paged
  cache (cached prefixes included), and ``store_kv``: new keys/values into their slots;
- ``kv_pack``: a request's blocks of some layers <-> one contiguous transfer buffer;
- ``rms_norm`` (+ residual add), ``rotary`` (in place), ``activation`` (SiLU-and-mul);
- ``attention``: the ``AttentionBackend`` interface the engine runs its layers' attention
  through, and its torch reference backend; ``triton_backend`` implements it on these kernels
  (chosen on CUDA), ``cpu_backend`` on the C++ CPU kernels (``cpu_attention``).

Every module imports without Triton (``triton_utils``); launching a kernel then raises
``TritonUnavailableError``. Compiled kernels need CUDA tensors; ``interpret`` explains how to
run them on CPU in Triton's interpreter (the tests do).
"""
