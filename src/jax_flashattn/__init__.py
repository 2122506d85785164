"""jax_flashattn: FlashAttention kernels for JAX, a drop-in for jax.nn.dot_product_attention."""

from jax_flashattn._ffi import backward_kernel, cuda_architectures, cuda_built, forward_kernel
from jax_flashattn.attention import attention

__all__ = ["attention", "cuda_built", "cuda_architectures", "forward_kernel", "backward_kernel"]
__version__ = "0.1.0"
