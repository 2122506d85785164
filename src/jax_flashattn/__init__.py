"""jax_flashattn: FlashAttention kernels for JAX, a drop-in for jax.nn.dot_product_attention."""

from jax_flashattn._ffi import backward_kernel, cuda_architectures, cuda_built, forward_kernel
from jax_flashattn.attention import attention
from jax_flashattn.fp8 import dequantize_fp8, quantize_fp8
from jax_flashattn.paged import paged_attention, paged_cache_update
from jax_flashattn.segments import segment_ids_from_lengths, segment_ids_from_offsets

__all__ = ["attention", "cuda_built", "cuda_architectures", "forward_kernel", "backward_kernel",
           "segment_ids_from_lengths", "segment_ids_from_offsets", "paged_attention",
           "paged_cache_update", "quantize_fp8", "dequantize_fp8"]
__version__ = "0.1.0"
