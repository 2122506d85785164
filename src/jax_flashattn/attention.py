"""`attention`: the public entry point, a drop-in for `jax.nn.dot_product_attention`."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from jax_flashattn import (_cache_kernel, _ffi, _forward_only, _ops, _sinks, _validate, fp8,
                           reference, sharding)

_UNSUPPORTED_DERIVATIVE = (
    "jax_flashattn.attention: forward-mode derivatives (jax.jvp, jax.jacfwd, jax.linearize) and "
    "second-order ones (jax.hessian, jax.grad of jax.grad) are not supported by jax_flashattn's "
    "kernels, which have a first-order reverse-mode rule only (jax.grad, jax.vjp); "
    "implementation=\"xla\" provides them")
# What JAX raises when a custom_vjp function meets forward-mode differentiation.
_JAX_JVP_OF_CUSTOM_VJP = "can't apply forward-mode autodiff (jvp) to a custom_vjp"


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_only(kernel_call, *operands):
    """kernel_call(*operands), for the kernel calls inside _flash's fwd and bwd rules: JAX
    differentiates those rules only for a derivative of a derivative (or a forward-mode one
    over a reverse-mode one), which then raises _UNSUPPORTED_DERIVATIVE at trace time instead of
    failing on the partitioned op inside."""
    return kernel_call(*operands)


@_first_order_only.defjvp
def _first_order_only_jvp(kernel_call, primals, tangents):
    del kernel_call, primals, tangents
    raise TypeError(_UNSUPPORTED_DERIVATIVE)


# switches: the kernel switches (_ffi.KernelSwitches), read by `attention` each time it runs or
# is traced and passed down as static data, so that no cached trace below keeps a stale one.
# window: the kernels' (left, right) and whether it moves per batch entry with the lengths
# (_validate.Normalized.kernel_window, align_window_to_lengths).
# alibi_shift: ALiBi's static diagonal (_validate.Normalized.alibi_shift).
@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13, 14, 15, 16, 17))
def _flash(q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids, sinks, alibi, scale, soft_cap,
           window, aligned, alibi_shift, deterministic, switches):
    out, lse = sharding.forward(q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi,
                                scale=scale, soft_cap=soft_cap, window=window,
                                align_window_to_lengths=aligned, switches=switches,
                                alibi_shift=alibi_shift)
    return _sinks.apply(out, lse, sinks)


def _flash_fwd(q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids, sinks, alibi, scale,
               soft_cap, window, aligned, alibi_shift, deterministic, switches):
    # With symbolic zeros, each array argument comes as CustomVJPPrimal(value, perturbed):
    # perturbed says whether its gradient is asked for (not under jax.grad of the other
    # arguments alone, nor behind stop_gradient).
    del deterministic  # a backward option
    dbias_needed = bias is not None and bias.perturbed
    dsinks_needed = sinks is not None and sinks.perturbed
    dslopes_needed = alibi is not None and alibi.perturbed
    q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids, sinks, alibi = (
        None if x is None else x.value
        for x in (q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids, sinks, alibi))
    kernel = functools.partial(sharding.forward, scale=scale, soft_cap=soft_cap, window=window,
                               align_window_to_lengths=aligned, switches=switches,
                               alibi_shift=alibi_shift)
    out, lse = _sinks.apply(*_first_order_only(kernel, q, k, v, bias, mask, q_lens, kv_lens,
                                               q_ids, kv_ids, alibi), sinks)
    # Only the inputs, the output and the log-sum-exp are saved: the backward recomputes P.
    # Whether dbias and dslopes are needed travels as the residuals' structure (() or None, no
    # array); the sinks are saved only where their gradient is (it reads out and dO once more).
    return (out, lse), (q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids,
                        sinks if dsinks_needed else None, alibi, out, lse,
                        () if dbias_needed else None, () if dslopes_needed else None)


def _flash_bwd(scale, soft_cap, window, aligned, alibi_shift, deterministic, switches, residuals,
               cotangents):
    (q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids, sinks, alibi, out, lse, dbias_needed,
     dslopes_needed) = residuals  # sinks: None unless their gradient is needed
    d_out, _ = cotangents  # the lse output is a residual with no gradient, as in jax.nn
    if isinstance(d_out, jax.custom_derivatives.SymbolicZero):  # only lse was used
        return (None,) * 11
    kernel = functools.partial(sharding.backward, scale=scale, soft_cap=soft_cap, window=window,
                               align_window_to_lengths=aligned, switches=switches,
                               deterministic=deterministic, dbias=dbias_needed is not None,
                               alibi_shift=alibi_shift, dslopes=dslopes_needed is not None)
    dq, dk, dv, dbias, dslopes = _first_order_only(kernel, q, k, v, out, lse, d_out, bias, mask,
                                                   q_lens, kv_lens, q_ids, kv_ids, alibi)
    if dbias is not None:  # already summed over bias's broadcast dims by sharding.backward
        dbias = dbias.astype(bias.dtype)
    return (dq, dk, dv, dbias, None, None, None, None, None,
            None if sinks is None else _sinks.gradient(sinks, out, lse, d_out), dslopes)


# symbolic_zeros: the backward computes (and allocates) the bias's and the ALiBi slopes'
# gradients only where they are needed; the kernels sum the bias's into its shape (float32;
# [B, N, T, S] with deterministic_backward, summed after).
_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


def _available_implementations(platform: str) -> tuple:
    """The values of `implementation` that can run on this default backend."""
    kernels = {"cpu": ("cpu",), "gpu": ("cuda",) if _ffi.cuda_built() else ()}.get(platform, ())
    return (None, *kernels, "xla", *(("cudnn",) if platform == "gpu" else ()))


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
    if implementation == "cudnn" and platform != "gpu":
        raise ValueError(f"implementation='cudnn' needs a GPU with cuDNN, but the default backend "
                         f"is {platform!r}; available here: "
                         f"{_available_implementations(platform)}")
    if implementation in ("xla", "cudnn"):
        return implementation
    if implementation is None and platform == "gpu" and not _ffi.cuda_built():
        warnings.warn("jax_flashattn was built without CUDA; falling back to "
                      "jax.nn.dot_product_attention(implementation='xla')", stacklevel=3)
        return "xla"
    return "kernels"


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              implementation=None, return_residual=False, deterministic_backward=False,
              query_segment_ids=None, key_value_segment_ids=None, logits_soft_cap=None,
              diagonal_alignment="top_left", sinks=None, alibi_slopes=None, descale_q=None,
              descale_k=None, descale_v=None, output_dtype=None):
    """Scaled dot-product attention with the signature of `jax.nn.dot_product_attention`.

    Layout [B, T, N, H] (or [T, N, H]); key and value [B, S, K, H] with N % K == 0 (GQA/MQA
    read the shared head, nothing is copied). `bias` (float) and `mask` (bool, True = keep)
    broadcast to [B, N, T, S]. `is_causal` lets query i see keys j <= i; `local_window_size`
    (l, r) lets it see [i - l, i + r] (a side above 2**62 acts as 2**62, which reaches every
    key); positions are absolute (a packed row's documents share them). The seq lengths are
    [B] padding masks: int32, or int8, int16, uint8, uint16; a numpy or Python sequence of
    another integer dtype (np.array([5, 7]) is int64) is taken when its values fit int32.
    K/V rows past a length never reach a result, on any kernel: a padded cache may hold
    anything there. `scale` is a static number, finite in float32.

    NaN and Inf: a NaN or +inf logit that a row sees makes that row's output, lse and dq NaN,
    and the dk, dv of the keys it sees, as in jax.nn (whose gradients are NaN in more places
    where masking hides the NaN); -inf in the bias hides a key as the mask does. With
    `logits_soft_cap` the cap bounds scale * q.k first (+inf included), so only a NaN there or
    a +inf bias does.

    One difference from jax.nn: a query row that sees no key, or whose visible logits are all
    -inf, returns 0 (lse -inf) rather than an average of V (or NaN). `return_residual=True`
    returns (out, lse) with lse float32 [B, T, N] (natural log), which carries no gradient, as
    in jax.nn. Zero-size inputs (B, T, S, N or H = 0, K >= 1) give what jax.nn gives, with no
    kernel run: empty arrays, or for S = 0 rows that see no key (out 0, lse -inf); their
    gradients are 0.

    Derivatives: first-order reverse mode (jax.grad, jax.vjp). Forward-mode and second-order
    derivatives (jax.jvp, jax.jacfwd, jax.hessian, grad of grad) raise a TypeError saying so
    and that implementation="xla" supports them; where JAX meets a jvp only when it compiles
    or runs it (jax.jvp of a jitted function, the linear function jax.linearize returns), the
    TypeError is JAX's own "can't apply forward-mode autodiff (jvp) to a custom_vjp function".

    `implementation`: None (our kernels for the default backend; on a GPU with a build that has
    no CUDA kernels, a warning and jax.nn's "xla"), "cpu", "cuda" (our kernels, raising if they
    cannot run), or "xla"/"cudnn" (delegate to jax.nn.dot_product_attention).

    `query_segment_ids` [B, T] and `key_value_segment_ids` [B, S] (keyword-only, not in jax.nn;
    [T] and [S] when unbatched; int32 or a dtype that fits it): packed sequences. Query i sees
    key j only where their ids are equal, on top of every other option; give both or neither.
    `segment_ids_from_lengths` and `segment_ids_from_offsets` build them from document
    lengths or cu_seqlens-style offsets. The CPU kernels skip the tiles whose ids cannot
    match, the GPU forward their products, ring attention the steps between documents.
    With implementation="xla" or "cudnn" they become a boolean mask [B, 1, T, S] for jax.nn.

    `logits_soft_cap` (keyword-only, not in jax.nn): a static number > 0 or None. The scaled
    logits s = scale q.k become cap * tanh(s / cap) before the bias and every mask (Gemma 2's
    order), with gradients through the tanh. With implementation="xla" or "cudnn" (jax.nn has
    no soft-capping) it raises a ValueError.

    `diagonal_alignment` (keyword-only, not in jax.nn): "top_left" (default, jax.nn's rule) or
    "bottom_right": query i sits at position i + S - T for `is_causal` and
    `local_window_size`, so with T < S (a prefill against a cache) the last query sees every
    key, and with T > S the first T - S queries of a causal call see none (cuDNN's
    BOTTOM_RIGHT, FlashAttention's convention). With seq lengths query i of batch entry b sits
    at i + kv_len_b - q_len_b instead (each length T or S where not given, and clamped to
    [0, T] and [0, S]). The kernels take it as a shifted window, moved per batch entry with
    lengths, so it costs nothing; with implementation="xla" or "cudnn" it becomes a boolean
    mask [T, S] for jax.nn ([B, 1, T, S] with lengths). A call with lengths runs unsplit
    along a sharded sequence (gathered, as for a bias that varies along it), and
    `sharding.ring_attention` refuses it.

    `sinks` (keyword-only, not in jax.nn): an array [N] of one logit per query head (float32
    or a real dtype, cast to float32), differentiable. Every row's softmax also takes a key of
    that logit and value 0 (gpt-oss's attention sinks), after the scale, the cap, the bias and
    the masks, which never hide it: a row that sees no key returns 0 with lse = the sink. The
    kernels run without it and the result is rescaled after (out e^(lse - lse'), one pass over
    the output); its gradient is -sum over the batch and rows of e^(sink - lse') dO . O. With
    implementation="xla" or "cudnn" (jax.nn has no sinks) it raises a ValueError.

    `alibi_slopes` (keyword-only, not in jax.nn): ALiBi (BLOOM, MPT), an array [N] or [B, N] of
    one slope per query head (float32 or a real dtype, cast to float32), differentiable. Query
    i and key j gain -slope * |i - j| in their logit, after the scale and the cap, with the
    bias, measured on the diagonal `diagonal_alignment` puts the queries on (i + S - T with
    "bottom_right", i + kv_len_b - q_len_b with seq lengths). The kernels compute it per pair
    (no [B, N, T, S] array); its gradient, -sum |i - j| dS over a head's pairs, comes from the
    backward's dQ pass. With implementation="xla" or "cudnn" it becomes a dense bias
    [B, N, T, S] for jax.nn. Along a sharded sequence it runs ring attention, each block's
    kernel call measuring the global distances (with seq lengths and "bottom_right", whose
    diagonal moves per batch entry, the sequences are gathered instead). Every kernel family
    computes it, on the CPU and the GPU, and the slopes' gradient in its backward.

    `deterministic_backward` (keyword-only, not in jax.nn): on a GPU, the gradients are
    bit-identical across runs. By default the tensor-core backward sums dQ over key blocks with
    float32 atomic adds, whose order varies between runs (last-bit differences). With True the
    Hopper backward (H100/H200) adds each query tile's dQ in a fixed order of key blocks, dK and
    dV unchanged (on an H200, forward+backward at 0.87-0.99x the default's speed at head dims 64
    and 128, 0.74-0.93x at 256); elsewhere (other GPUs, or segment ids, or a bias or mask of one
    key broadcast over the keys) the mma.sync family computes dQ in a second pass over the keys,
    which recomputes the scores and dP once more (7 matrix products per tile instead of 5). A
    bias broadcast over some dims gets its gradient summed into its own shape by float32 atomic
    adds by default; with True it is computed at the full [B, N, T, S] in float32 and summed
    after (more memory). The CPU kernels are deterministic either way, and so is the GPU's
    CUDA-core path (float32, head dims the tensor cores do not take) apart from a broadcast
    bias's gradient by default. It has no effect with implementation="xla" or "cudnn" (jax.nn's
    own backward).

    FP8 (keyword-only, not in jax.nn): key and value of float8_e4m3fn, with `descale_k` /
    `descale_v` (float32 scalars or [B, K], [K] unbatched; the real value is the stored one
    times its descale, 1 where None; jax_flashattn.quantize_fp8 makes them); query e4m3 too
    with `descale_q` (its heads taking their kv head's), the output then bfloat16, or
    `output_dtype` float16; or query bfloat16, float16 or float32 (a quantised KV cache), the
    output in its dtype. Every other option applies. Without a bias, mask, ALiBi, soft-cap,
    sinks or segment ids the kernels read e4m3 keys and values as stored beside a query of
    another dtype (dequantising each value as they load it): the CPU kernels always, a GPU's
    split-KV decode kernels for a bfloat16 or float16 query on a decoding shape of head dim a
    multiple of 16; FP8 attention (query e4m3 too) on Hopper (an sm_90a build) runs on the
    forward's e4m3 tensor-core kernel (head dim a multiple of 16 up to 256; P rounded to e4m3).
    Other calls are dequantised first: to float32 on the CPU (the reference semantics), to the
    output dtype on a GPU, where the kernels then run as for those inputs. Forward only:
    jax.grad raises a TypeError.
    """
    _validate.check_options(implementation=implementation,
                            deterministic_backward=deterministic_backward)
    if fp8.takes_fp8(query, key, value, descale_q, descale_k, descale_v, output_dtype):
        if (bias is None and mask is None and query_segment_ids is None
                and key_value_segment_ids is None and logits_soft_cap is None and sinks is None
                and alibi_slopes is None and _check_implementation(implementation) == "kernels"):
            options = dict(scale=scale, is_causal=is_causal,
                           query_seq_lengths=query_seq_lengths,
                           key_value_seq_lengths=key_value_seq_lengths,
                           local_window_size=local_window_size,
                           diagonal_alignment=diagonal_alignment, descale_q=descale_q,
                           descale_k=descale_k, descale_v=descale_v, output_dtype=output_dtype,
                           return_residual=return_residual)
            for in_kernel in (_fp8_kv_in_kernel, _e4m3_attention_in_kernel):
                out = in_kernel(query, key, value, **options)
                if out is not None:
                    return out
        q, k, v, out_dtype = fp8.dequantized_inputs(
            query, key, value, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
            output_dtype=output_dtype, float32=jax.default_backend() == "cpu")
        return fp8.result(attention(
            q, k, v, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation,
            return_residual=return_residual, deterministic_backward=deterministic_backward,
            query_segment_ids=query_segment_ids, key_value_segment_ids=key_value_segment_ids,
            logits_soft_cap=logits_soft_cap, diagonal_alignment=diagonal_alignment,
            sinks=sinks, alibi_slopes=alibi_slopes), out_dtype)
    kind = _check_implementation(implementation)
    args = _validate.normalize(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                               query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths,
                               local_window_size=local_window_size, allow_empty=True,
                               query_segment_ids=query_segment_ids,
                               key_value_segment_ids=key_value_segment_ids,
                               logits_soft_cap=logits_soft_cap,
                               diagonal_alignment=diagonal_alignment, sinks=sinks,
                               alibi_slopes=alibi_slopes)
    if args.soft_cap and kind != "kernels":
        raise ValueError(f"logits_soft_cap: jax.nn.dot_product_attention has no soft-capping, so "
                         f"this call, on its implementation={kind!r}, cannot take it")
    if args.sinks is not None and kind != "kernels":
        raise ValueError(f"sinks: jax.nn.dot_product_attention has no attention sinks, so this "
                         f"call, on its implementation={kind!r}, cannot take them")
    if kind != "kernels":
        # The lengths and window as checked: int32 (jax.nn takes no other dtype) and bounded
        # (jax.nn adds a side to int32 positions); segment ids and a bottom-right causal mask or
        # window as a mask (jax.nn has neither).
        return jax.nn.dot_product_attention(
            query, key, value, _jax_nn_bias(args, bias), _jax_nn_mask(args, mask), scale=scale,
            is_causal=is_causal and not args.aligned,
            query_seq_lengths=args.query_seq_lengths,
            key_value_seq_lengths=args.key_value_seq_lengths,
            local_window_size=None if args.aligned else _bounded_window(args),
            implementation=kind, return_residual=return_residual)
    if args.zero_size:
        return _zero_size_result(args, return_residual)
    out, lse = _call_kernels(args, deterministic_backward)
    out = out.reshape(args.out_shape)
    if not return_residual:
        return out
    lse = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2)).reshape(args.out_shape[:-1])
    return out, lse


def _e4m3_attention_in_kernel(query, key, value, *, descale_q, descale_k, descale_v,
                              output_dtype, return_residual, **options):
    """FP8 attention (query, key and value of float8_e4m3fn) on the Hopper forward's e4m3
    kernels (fp8.attention_kernels_take), or None for a call they do not take (the caller
    dequantises it first). `options`: the masking options, as `attention`'s."""
    if not all(fp8.is_e4m3(x) for x in (query, key, value)):
        return None
    out_dtype = fp8.OUTPUT_DTYPES[0] if output_dtype is None else jnp.dtype(output_dtype)
    if out_dtype not in fp8.OUTPUT_DTYPES:
        return None  # fp8.dequantized_inputs raises
    args = _validate.normalize(query, key, value, allow_empty=True, fp8_q=True, **options)
    if args.zero_size or not fp8.attention_kernels_take(
            args.query.shape, args.key.shape, out_dtype, scale=args.scale,
            has_q_lens=args.query_seq_lengths is not None,
            has_kv_lens=args.key_value_seq_lengths is not None,
            switches=_ffi.kernel_switches()):
        return None
    batch, kv_heads = args.query.shape[0], args.key.shape[2]
    unbatched = query.ndim == 3
    descale_k, descale_v = fp8.kernel_descales(descale_k, descale_v, batch, kv_heads, unbatched)
    if descale_q is not None:
        descale_k = descale_k * fp8.group_descale(descale_q, "descale_q", batch, kv_heads,
                                                  unbatched)
    return _on_cache_kernel(args, descale_k, descale_v, return_residual, e4m3_out_dtype=out_dtype)


def _fp8_kv_in_kernel(query, key, value, *, descale_q, descale_k, descale_v, output_dtype,
                      return_residual, **options):
    """`attention` of a query to float8_e4m3fn keys and values on the kernels that read them
    as stored (fp8.kernels_take: the CPU kernels, a GPU's decode kernels), or None for a call
    they do not take (the caller dequantises it first). `options`: the masking options, as
    `attention`'s."""
    if (fp8.is_e4m3(query) or not (fp8.is_e4m3(key) and fp8.is_e4m3(value))
            or descale_q is not None or output_dtype is not None):
        return None  # FP8 attention, or a call fp8.dequantized_inputs refuses
    args = _validate.normalize(query, key, value, allow_empty=True, fp8_kv=True, **options)
    if args.zero_size or not fp8.kernels_take(
            args.query.shape, args.query.dtype, args.key.shape, scale=args.scale,
            has_q_lens=args.query_seq_lengths is not None,
            has_kv_lens=args.key_value_seq_lengths is not None,
            switches=_ffi.kernel_switches()):
        return None
    k_descale, v_descale = fp8.kernel_descales(descale_k, descale_v, args.query.shape[0],
                                               args.key.shape[2], unbatched=query.ndim == 3)
    return _on_cache_kernel(args, k_descale, v_descale, return_residual)


def _on_cache_kernel(args: _validate.Normalized, k_descale, v_descale, return_residual: bool,
                     e4m3_out_dtype=None):
    """`attention`'s result from the kernel call on e4m3 keys and values as stored
    (`_cache_kernel.forward`: partitioned, each device its batch entries and kv heads; with
    `e4m3_out_dtype`, FP8 attention), out and lse in `attention`'s shapes."""
    kernel = functools.partial(_cache_kernel.forward, scale=args.scale,
                               window=args.kernel_window, switches=_ffi.kernel_switches(),
                               align_window_to_lengths=args.align_window_to_lengths,
                               e4m3_out_dtype=e4m3_out_dtype)
    # Forward only: its gradient raises fp8's TypeError before JAX meets the kernel op, which
    # has no derivative rule.
    out, lse = _forward_only.call(fp8.NO_GRADIENT, kernel, args.query, args.key, args.value,
                                  None, args.key_value_seq_lengths, args.query_seq_lengths,
                                  k_descale, v_descale)
    out = out.reshape(args.out_shape)
    if not return_residual:
        return out
    return out, jnp.swapaxes(lse, -1, -2).reshape(args.out_shape[:-1])


def _call_kernels(args: _validate.Normalized, deterministic_backward: bool):
    """(out [B, T, N, H], lse [B, N, T]) from the kernels, or _UNSUPPORTED_DERIVATIVE for
    forward-mode differentiation: when an operand is itself a jvp tracer (jax.jvp of a
    function that calls attention, jitted or not), or when JAX raises its own error for a jvp
    it evaluates at once (eagerly, under vmap). (A jvp that reaches attention only through
    another transformation, as jax.jit of jax.jvp of a vmapped or jitted function, fails when
    lowered, with JAX's own TypeError.)"""
    if _has_jvp_tangent(args):
        raise TypeError(_UNSUPPORTED_DERIVATIVE)
    # Inside shard_map the sinks (replicated) meet rows that vary over its axes: marked varying
    # as those, so that their cotangent, each device's part, is summed by shard_map itself.
    sinks, = _ops.vary_like((args.sinks,), (args.query, args.key, args.value))
    try:
        return _flash(args.query, args.key, args.value, args.bias, args.mask,
                      args.query_seq_lengths, args.key_value_seq_lengths,
                      args.query_segment_ids, args.key_value_segment_ids, sinks,
                      args.alibi_slopes, args.scale, args.soft_cap, args.kernel_window,
                      args.align_window_to_lengths, args.alibi_shift, deterministic_backward,
                      _ffi.kernel_switches())
    except TypeError as e:
        if _JAX_JVP_OF_CUSTOM_VJP not in str(e):
            raise
        raise TypeError(_UNSUPPORTED_DERIVATIVE) from e


def _has_jvp_tangent(args: _validate.Normalized) -> bool:
    """Whether an operand is being differentiated in forward mode. With direct linearization
    (JAX's default) reverse mode traces LinearizeTracers, so a JVPTracer comes from
    jax.jvp or jacfwd only; with it off, reverse mode also runs on JVPTracers, and this says
    False."""
    if not getattr(jax.config, "jax_use_direct_linearize", False):
        return False
    operands = (args.query, args.key, args.value, args.bias, args.mask, args.alibi_slopes)
    return any(isinstance(x, ad.JVPTracer) for x in operands)


def _alibi_logits(args: _validate.Normalized) -> jax.Array:
    """ALiBi's term float32 [B, N, T, S]: -slope |t + shift - s| (args.alibi_slopes given)."""
    t, s = args.query.shape[1], args.key.shape[1]
    shift = jnp.reshape(jnp.asarray(args.diagonal_shifts()), (-1, 1, 1, 1))
    distance = jnp.abs(jnp.arange(t)[:, None] + shift - jnp.arange(s)[None, :])
    return -args.alibi_slopes[:, :, None, None] * distance.astype(jnp.float32)


def _jax_nn_bias(args: _validate.Normalized, bias):
    """The caller's bias (as given), plus ALiBi's term as a dense [B, N, T, S] for jax.nn (in
    the query's dtype; [N, T, S] unbatched)."""
    if args.alibi_slopes is None:
        return bias
    dense = _alibi_logits(args)
    dense = dense[0] if len(args.out_shape) == 3 else dense
    if bias is not None:
        dense = dense + jnp.asarray(bias, jnp.float32)
    return dense.astype(args.query.dtype)


def _jax_nn_mask(args: _validate.Normalized, mask):
    """The caller's mask (as given), and for jax.nn what it has no option for: the segment
    ids' [B, 1, T, S] equality, and a bottom-right causal mask or window as [T, S] ([B, 1, T, S]
    with seq lengths, each entry's at its kv_len - q_len)."""
    unbatched = len(args.out_shape) == 3  # jax.nn broadcasts a [1, T, S] mask there
    if args.query_segment_ids is not None:
        same = (args.query_segment_ids[:, None, :, None] ==
                args.key_value_segment_ids[:, None, None, :])
        same = same[0] if unbatched else same
        mask = same if mask is None else jnp.logical_and(mask, same)
    if args.aligned:
        b, t = args.query.shape[:2]
        per_entry = args.align_window_to_lengths  # [B, 1, T, S], else one [T, S]
        keep = reference.visibility(t, args.key.shape[1], batch=b if per_entry else 1,
                                    is_causal=args.is_causal, window=_bounded_window(args),
                                    q_lens=None, kv_lens=None, mask=None,
                                    shift=args.diagonal_shifts())
        keep = (keep[0] if unbatched else keep) if per_entry else keep[0, 0]
        mask = keep if mask is None else jnp.logical_and(mask, keep)
    return mask


def _bounded_window(args: _validate.Normalized) -> tuple[int, int] | None:
    """args.window with each side at most max(T, S), which hides no more keys than a larger
    side, for code whose positions are int32 (jax.nn, reference.visibility)."""
    if args.window is None:
        return None
    bound = max(args.query.shape[1], args.key.shape[1])
    return min(args.window[0], bound), min(args.window[1], bound)


def _zero_size_result(args: _validate.Normalized, return_residual: bool):
    """`attention` of a call where B, T, S, N or H is 0, without the kernels: out is 0 (empty, or
    with S = 0 every row sees no key), a constant, so every gradient is 0, as from jax.nn."""
    out = jnp.zeros(args.out_shape, args.query.dtype)
    if not return_residual:
        return out
    return out, jax.lax.stop_gradient(_zero_size_lse(args)).reshape(args.out_shape[:-1])


def _zero_size_lse(args: _validate.Normalized) -> jax.Array:
    """lse [B, T, N] float32 of a call where B, T, S, N or H is 0 (Normalized.zero_size): -inf
    where a row sees no key, so everywhere when S = 0. With H = 0 and keys to see, every q.k is
    an empty sum, 0, so the logits are the bias and ALiBi alone (0 without them) and lse is their
    log-sum-exp over the keys the row sees, as jax.nn's with a given scale; with sinks, each
    row's log-sum-exp takes its head's sink too."""
    b, t, n, _ = args.query.shape
    s = args.key.shape[1]
    if b * t * n * s == 0:
        lse = jnp.full((b, t, n), -jnp.inf, jnp.float32)
        return lse if args.sinks is None else jnp.logaddexp(lse, args.sinks)
    keep = reference.visibility(t, s, batch=b, is_causal=args.is_causal,
                                window=_bounded_window(args), q_lens=args.query_seq_lengths,
                                kv_lens=args.key_value_seq_lengths, mask=args.mask,
                                q_segment_ids=args.query_segment_ids,
                                kv_segment_ids=args.key_value_segment_ids,
                                shift=args.diagonal_shifts())
    logits = jnp.zeros((), jnp.float32) if args.bias is None else args.bias.astype(jnp.float32)
    if args.alibi_slopes is not None:
        logits = logits + _alibi_logits(args)
    logits = jnp.broadcast_to(jnp.where(keep, logits, -jnp.inf), (b, n, t, s))
    lse = jax.nn.logsumexp(logits, axis=-1)
    if args.sinks is not None:
        lse = jnp.logaddexp(lse, args.sinks[:, None])
    return jnp.swapaxes(lse, -1, -2)
