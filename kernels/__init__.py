"""splitserve.kernels: Triton kernels with torch references (see issue: kernels and the GPU path)."""
