"""GPU kernels (Triton) used by the vLLM adapter; importing this package does
not import vLLM, and the kernel modules import Triton only where it exists."""
