"""Loads the compiled extension and registers its FFI handlers with XLA, once, on import."""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
import numpy as np

try:
    from jax_flashattn import _jax_flashattn as _ext
except ImportError as e:  # a source tree on sys.path, or an install whose build failed
    raise ImportError(
        f"jax_flashattn's compiled extension could not be imported for the package at "
        f"{os.path.dirname(__file__)}. If that is a source tree on sys.path, install the package "
        f"(python3 -m pip install ., or -e . for development) and import it without the tree's "
        f"src/ folder on sys.path; otherwise reinstall it and read the build's output") from e

FORWARD_TARGET = "jax_flashattn_fwd"
BACKWARD_TARGET = "jax_flashattn_bwd"

# {platform: {target name: capsule}}: "cpu" always, "CUDA" when the CUDA part was built.
_REGISTRATIONS = _ext.registrations()
for _platform, _targets in _REGISTRATIONS.items():
    for _name, _capsule in _targets.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


def cuda_built() -> bool:
    """Whether this install carries the CUDA kernels."""
    return "CUDA" in _REGISTRATIONS


def cuda_architectures() -> list[str]:
    """The GPU architectures the CUDA kernels were compiled for (empty without CUDA)."""
    return list(_ext.cuda_architectures())


_DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}

# The kernel switches: environment variable -> the call attribute that carries it. Each is on
# when set to anything but "" or "0". JAX_FLASHATTN_DISABLE_SM90 sends Hopper calls to the
# mma.sync family (decoding calls to "decode"); JAX_FLASHATTN_SM80_CP_ASYNC keeps that family's
# K/V loads on cp.async on Hopper (as on other GPUs) instead of TMA.
_SWITCHES = {"JAX_FLASHATTN_DISABLE_SM90": "disable_sm90",
             "JAX_FLASHATTN_SM80_CP_ASYNC": "sm80_cp_async"}


class KernelSwitches(NamedTuple):
    """The kernel switches of one call: static (hashable) data that travels from the public
    functions, which read them from the environment when they run or are traced, down to the
    custom call's attributes. Part of the compiled program, so a jitted function keeps the
    kernels it was traced with (XLA may replay them from a CUDA graph) and a change takes
    effect at the next trace."""
    disable_sm90: bool = False
    sm80_cp_async: bool = False

    def attrs(self) -> dict:
        """The custom call's attributes (int32 0/1, as ffi/call_frame.h decodes them)."""
        return {name: np.int32(value) for name, value in self._asdict().items()}


def kernel_switches() -> KernelSwitches:
    """The kernel switches the environment sets now."""
    return KernelSwitches(**{attr: os.environ.get(name, "") not in ("", "0")
                             for name, attr in _SWITCHES.items()})


def _device_with_kernels(device):
    """`device` (default: the first JAX device) if it is a CPU or an NVIDIA GPU this install has
    CUDA kernels for; raises ValueError otherwise."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "cpu" and (device.platform != "gpu" or not cuda_built()):
        raise ValueError(f"device must be a CPU or an NVIDIA GPU with jax_flashattn's CUDA kernels "
                         f"built, got {device}")
    return device


class CallPlan(NamedTuple):
    """What a call runs and needs (ffi/plan.h). `decode_workspace_floats`: float32 elements of
    the forward's decode workspace (the split-KV decode kernels' partial results, sized for the
    largest GPU the C++ split rule plans for; 0 when the call never takes a decode kernel).
    `dq_semaphores`: int32 elements of the backward's dQ semaphores (the Hopper kernel's
    deterministic mode; 0 for a call that is not deterministic). `dslopes_slots`: float32
    partial sums per (batch entry, head) of the backward's ALiBi slopes gradient, which the
    caller adds up (ffi/params.h). `forward_workspace_ints`: int32 elements of the forward's
    workspace (the Hopper kernel's tile counter, and with segment ids its tile order);
    `backward_workspace_ints` those of the backward's (the dQ semaphores, and with segment ids
    the Hopper kernel's block order). With a device: the forward and
    backward kernel families, and a decode call's key splits per (batch entry, kv head) and
    their merge ("cluster", "paired_cluster" or "combine"; 0 and "" for any other call).
    Without one those are "", "", 0, ""."""
    decode_workspace_floats: int
    dq_semaphores: int
    dslopes_slots: int
    forward_workspace_ints: int
    backward_workspace_ints: int
    forward: str
    backward: str
    decode_splits: int
    decode_merge: str


def call_shape(query_shape, key_shape, dtype, *, scale=None, has_bias=False, has_mask=False,
               has_q_seqlens=False, has_kv_seqlens=False, has_segment_ids=False,
               has_alibi=False, deterministic=False, soft_cap=0.0, bias_broadcasts_keys=False,
               mask_broadcasts_keys=False, switches: KernelSwitches | None = None,
               e4m3_attention=False):
    """The extension's CallShape of a call with q [..., B, T, N, H] and k [..., B, S, K, H] of
    `dtype` (any dtype: one no kernel takes plans no workspace), `scale` (default H ** -0.5),
    the optional operands it passes (and whether the bias or mask is one key broadcast over
    S > 1), its soft-cap (0: none), and `switches` (default: the environment's now);
    `e4m3_attention`: FP8 attention (q, k and v float8_e4m3fn, `dtype` the output's). Set by
    field name, so nothing depends on an argument order across the boundary."""
    *lead, t, n, h = query_shape
    if scale is None:
        scale = h ** -0.5 if h else 1.0
    switches = kernel_switches() if switches is None else switches
    shape = _ext.CallShape()
    fields = dict(dtype=_DTYPE_CODES.get(jax.numpy.dtype(dtype).name, -1),
                  batch=math.prod(lead), batch_inner=lead[-1] if lead else 1, seqlen_q=t,
                  seqlen_k=key_shape[-3], num_heads=n, num_kv_heads=key_shape[-2], head_dim=h,
                  scale=float(scale), logits_soft_cap=float(soft_cap), has_bias=bool(has_bias),
                  has_mask=bool(has_mask),
                  has_q_seqlens=bool(has_q_seqlens), has_kv_seqlens=bool(has_kv_seqlens),
                  has_segment_ids=bool(has_segment_ids), has_alibi=bool(has_alibi),
                  deterministic=bool(deterministic),
                  bias_broadcasts_keys=bool(bias_broadcasts_keys),
                  mask_broadcasts_keys=bool(mask_broadcasts_keys),
                  e4m3_attention=bool(e4m3_attention), **switches._asdict())
    for name, value in fields.items():
        setattr(shape, name, value)
    return shape


def plan(shape, device=None) -> CallPlan:
    """The plan of a call_shape: on `device` (a CPU or an NVIDIA GPU this install has kernels
    for; ValueError otherwise), or the workspace alone with device=None."""
    device = None if device is None else _device_with_kernels(device)
    if device is None or device.platform == "cpu":  # the CPU kernels take no planning
        family = "" if device is None else "cpu"
        p = _ext.plan(shape, -1)
        return CallPlan(int(p.decode_workspace_floats), int(p.dq_semaphores),
                        int(p.dslopes_slots), int(p.forward_workspace_ints),
                        int(p.backward_workspace_ints), family, family, 0, "")
    p = _ext.plan(shape, device.local_hardware_id)
    return CallPlan(int(p.decode_workspace_floats), int(p.dq_semaphores),
                    int(p.dslopes_slots), int(p.forward_workspace_ints),
                    int(p.backward_workspace_ints), p.forward, p.backward, int(p.decode_splits),
                    p.decode_merge)


def _kernel_query(query, key, device, **options) -> CallPlan:
    """The plan of a call of these shapes and dtype on `device` (default: the first JAX device),
    with the default scale: the public kernel queries' common part (TypeError for a dtype no
    kernel takes)."""
    dtype = jax.numpy.dtype(query.dtype).name
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"query must be float32, bfloat16 or float16, got {dtype}")
    return plan(call_shape(query.shape, key.shape, query.dtype, **options),
                jax.devices()[0] if device is None else device)


def forward_kernel(query, key, bias=None, mask=None, *, query_segment_ids=None,
                   key_value_segment_ids=None, logits_soft_cap=None, alibi_slopes=None,
                   device=None) -> str:
    """Which forward kernel family `attention` runs for these inputs on `device` (default: the
    first JAX device): "sm90" (TMA + wgmma, Hopper), "sm80" (mma.sync), "decode" (split-KV
    mma.sync, for few query rows against many keys), "decode_sm90" (split-KV wgmma, Hopper, for
    decoding shapes with 32 or more query rows per kv head and head dims up to 128), "simt"
    (CUDA cores) on an NVIDIA GPU, "cpu" on the host. Reads only shapes and dtypes (arrays or
    jax.ShapeDtypeStruct) and the kernel switches in the environment now (kernel_switches);
    assumes the default scale; contiguous inputs as XLA lays them out are assumed. Segment ids
    count only as given or not (both are needed by `attention`; either one counts here),
    `logits_soft_cap` as given (a number) or not, and `alibi_slopes` as given or not."""
    return _kernel_query(query, key, device, **_bias_and_mask(bias, mask, key),
                         has_segment_ids=_has_segment_ids(query_segment_ids,
                                                          key_value_segment_ids),
                         soft_cap=_soft_cap_given(logits_soft_cap),
                         has_alibi=alibi_slopes is not None).forward


def decode_layout(query, key, *, key_value_seq_lengths=False, logits_soft_cap=None,
                  device=None) -> tuple[int, str]:
    """(splits, merge) of a call without bias or mask on `device` (default: the first JAX
    device) that takes a split-KV decode kernel ("decode", "decode_sm90"): its key ranges per
    (batch entry, kv head), and "cluster" where they merge inside their thread block cluster
    (compute capability 9.0+, at most 8 blocks per cluster, every cluster resident at once),
    "paired_cluster" where each block runs two splits (one per warpgroup, "decode_sm90" only)
    and the blocks merge them in their cluster, or "combine" where they merge through a second
    kernel; (0, "") for any other call.
    `key_value_seq_lengths`: whether the call passes them (it then aims at more splits);
    `logits_soft_cap` as forward_kernel's (a capped call runs the decode kernels' instantiations
    for the cap, whose clusters are asked on their own). Shapes and dtypes only, as
    forward_kernel."""
    p = _kernel_query(query, key, device, has_kv_seqlens=bool(key_value_seq_lengths),
                      soft_cap=_soft_cap_given(logits_soft_cap))
    return p.decode_splits, p.decode_merge


def backward_kernel(query, key, bias=None, mask=None, *, deterministic=False,
                    query_segment_ids=None, key_value_segment_ids=None, logits_soft_cap=None,
                    alibi_slopes=None, device=None) -> str:
    """Which backward kernel family the gradient of `attention` runs for these inputs on
    `device` (default: the first JAX device): "sm90" (TMA + wgmma, Hopper), "sm80" (mma.sync),
    "simt" (CUDA cores) on an NVIDIA GPU, "cpu" on the host. `deterministic` is attention's
    `deterministic_backward`. Reads only shapes and dtypes (arrays or jax.ShapeDtypeStruct) and
    the kernel switches in the environment now; assumes the default scale; contiguous inputs as
    XLA lays them out are assumed; segment ids, `logits_soft_cap` and `alibi_slopes` count as
    forward_kernel's."""
    return _kernel_query(query, key, device, **_bias_and_mask(bias, mask, key),
                         deterministic=deterministic,
                         has_segment_ids=_has_segment_ids(query_segment_ids,
                                                          key_value_segment_ids),
                         soft_cap=_soft_cap_given(logits_soft_cap),
                         has_alibi=alibi_slopes is not None).backward


def _bias_and_mask(bias, mask, key) -> dict:
    """The planner's flags for a bias and mask given as arrays (or shapes): whether each is
    present, and whether it is one key broadcast over the S > 1 keys."""
    def one_key(x):  # a scalar broadcasts over the keys too
        return x is not None and (np.ndim(x) == 0 or np.shape(x)[-1] == 1) and key.shape[-3] > 1
    return dict(has_bias=bias is not None, has_mask=mask is not None,
                bias_broadcasts_keys=one_key(bias), mask_broadcasts_keys=one_key(mask))


def _has_segment_ids(query_segment_ids, key_value_segment_ids) -> bool:
    return query_segment_ids is not None or key_value_segment_ids is not None


def _soft_cap_given(logits_soft_cap) -> float:
    """A soft-cap for the planner, which asks only whether there is one: 1.0 when given."""
    return 0.0 if logits_soft_cap is None else 1.0
