"""`attention`: the public entry point, a drop-in for `jax.nn.dot_product_attention`."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from jax_flashattn import _ffi, _validate, sharding



# switches: the kernel switches (_ffi.KernelSwitches), read by `attention` each time it runs or
# is traced and passed down as static data, so that no cached trace below keeps a stale one.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, bias, mask, q_lens, kv_lens, scale, window, deterministic, switches):
    return sharding.forward(q, k, v, bias, mask, q_lens, kv_lens, scale=scale, window=window,
                            switches=switches)


def _flash_fwd(q, k, v, bias, mask, q_lens, kv_lens, scale, window, deterministic, switches):
    del deterministic  # a backward option
    out, lse = sharding.forward(q, k, v, bias, mask, q_lens, kv_lens, scale=scale, window=window,
                                switches=switches)
    # Only the inputs, the output and the log-sum-exp are saved: the backward recomputes P.
    return (out, lse), (q, k, v, bias, mask, q_lens, kv_lens, out, lse)


def _flash_bwd(scale, window, deterministic, switches, residuals, cotangents):
    q, k, v, bias, mask, q_lens, kv_lens, out, lse = residuals
    d_out, _ = cotangents  # the lse output is a residual with no gradient, as in jax.nn
    dq, dk, dv, dbias = sharding.backward(q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens,
                                          scale=scale, window=window, switches=switches,
                                          deterministic=deterministic)
    if bias is not None:  # already summed over bias's broadcast dims by sharding.backward
        dbias = dbias.astype(bias.dtype)
    return dq, dk, dv, dbias, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_implementation(implementation) -> str:
    """Resolves `implementation` (already checked to be one of _validate.IMPLEMENTATIONS) to
    "kernels" or a jax.nn implementation name."""
    platform = jax.default_backend()
    if implementation == "cpu" and platform != "cpu":
        raise ValueError(f"implementation='cpu' needs the CPU backend, but the default backend "
                         f"is {platform!r}")
    if implementation == "cuda":
        if platform != "gpu":
            raise ValueError(f"implementation='cuda' needs a GPU, but the default backend is "
                             f"{platform!r}")
        if not _ffi.cuda_built():
            raise ValueError("implementation='cuda': this jax_flashattn was built without CUDA; "
                             "reinstall it where nvcc is found (or with "
                             "-C cmake.define.JAX_FLASHATTN_CUDA=ON)")
    if implementation in ("xla", "cudnn"):
        return implementation
    if implementation is None and platform == "gpu" and not _ffi.cuda_built():
        warnings.warn("jax_flashattn was built without CUDA; falling back to "
                      "jax.nn.dot_product_attention(implementation='xla')", stacklevel=3)
        return "xla"
    return "kernels"


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              implementation=None, return_residual=False, deterministic_backward=False):
    """Scaled dot-product attention with the signature of `jax.nn.dot_product_attention`.

    Layout [B, T, N, H] (or [T, N, H]); key and value [B, S, K, H] with N % K == 0 (GQA/MQA
    read the shared head, nothing is copied). `bias` (float) and `mask` (bool, True = keep)
    broadcast to [B, N, T, S]. `is_causal` lets query i see keys j <= i; `local_window_size`
    (l, r) lets it see [i - l, i + r]; the seq lengths are int [B] padding masks. K/V rows
    past a length are left out of the softmax but must be finite, as in jax.nn: on a GPU a
    NaN or Inf there can reach the output and gradients (README).

    One difference from jax.nn: a query row that sees no key returns 0 (lse -inf) rather than
    an average of V. `return_residual=True` returns (out, lse) with lse float32 [B, T, N]
    (natural log), which carries no gradient, as in jax.nn.

    `implementation`: None (our kernels for the default backend), "cpu", "cuda" (our kernels,
    raising if they cannot run), or "xla"/"cudnn" (delegate to jax.nn.dot_product_attention).

    `deterministic_backward` (keyword-only, not in jax.nn): on a GPU, the gradients are
    bit-identical across runs. By default the tensor-core backward sums dQ over key blocks
    with float32 atomic adds, whose order varies between runs (last-bit differences); with
    True it computes dQ in a second pass over the keys instead, which recomputes the scores
    and dP once more (7 matrix products per tile instead of 5, so roughly 1.4x the
    backward's time by that count; not yet measured). The CPU kernels and the GPU's CUDA-core
    path (float32, head dims the tensor cores do not take) are deterministic either way. It
    has no effect with implementation="xla" or "cudnn" (jax.nn's own backward).
    """
    _validate.check_options(implementation=implementation,
                            deterministic_backward=deterministic_backward)
    kind = _check_implementation(implementation)
    args = _validate.normalize(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                               query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths,
                               local_window_size=local_window_size)
    if kind != "kernels":
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=kind,
            return_residual=return_residual)
    out, lse = _flash(args.query, args.key, args.value, args.bias, args.mask,
                      args.query_seq_lengths, args.key_value_seq_lengths, args.scale,
                      args.kernel_window, deterministic_backward, _ffi.kernel_switches())
    out = out.reshape(args.out_shape)
    if not return_residual:
        return out
    lse = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2)).reshape(args.out_shape[:-1])
    return out, lse
