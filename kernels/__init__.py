"""splitserve.kernels: Triton kernels, each with a torch reference (the GPU-path issue)."""
