"""C++ CPU kernels, JIT-built on first use (loader.py); callers fall back to torch without them."""

from kvpipe.model.cpu.kernels.paged_decode import PagedDecode, paged_decode_kernel

__all__ = ["PagedDecode", "paged_decode_kernel"]
