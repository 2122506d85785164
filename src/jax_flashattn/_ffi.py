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


def _kernel_query(query, device):
    """The device a kernel-choice query is about and query's dtype code (TypeError for a dtype
    no kernel takes)."""
    dtype = jax.numpy.dtype(query.dtype).name
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"query must be float32, bfloat16 or float16, got {dtype}")
    return _device_with_kernels(device), _DTYPE_CODES[dtype]


def decode_workspace_size(q_shape, k_shape, dtype, *, scale: float, has_bias: bool,
                          has_mask: bool) -> int:
    """Float32 elements of the decode kernel's workspace for q [..., B, T, N, H] and
    k [..., B, S, K, H]: its splits' partial O and lse ([B*K, splits, T*N/K, H + 1]) at the
    largest split count the C++ rule (ffi/decode_plan.h) gives a call of this shape
    (with per-batch key lengths) on a GPU with the most SMs it sizes for (a device with more
    runs as many splits as this holds); 0 when the call can never take the decode kernel."""
    *lead, t, n, h = q_shape
    code = _DTYPE_CODES.get(jax.numpy.dtype(dtype).name)
    if code is None:
        return 0
    return _ext.decode_workspace_floats(
        code, int(np.prod(lead, dtype=np.int64)), t, k_shape[-3], n, k_shape[-2], h,
        float(scale), has_bias, has_mask, _ext.DECODE_MAX_MULTIPROCESSORS)


def _decode_floats(query, key, has_bias: bool, has_mask: bool) -> int:
    """The decode workspace a call of these shapes gets at trace time (default scale)."""
    h = query.shape[-1]
    return decode_workspace_size(query.shape, key.shape, query.dtype,
                                 scale=h ** -0.5 if h else 1.0, has_bias=has_bias,
                                 has_mask=has_mask)


def forward_kernel(query, key, bias=None, mask=None, *, device=None) -> str:
    """Which forward kernel family `attention` runs for these inputs on `device` (default: the
    first JAX device): "sm90" (TMA + wgmma, Hopper), "sm80" (mma.sync), "decode" (split-KV
    mma.sync, for few query rows against many keys), "decode_sm90" (split-KV wgmma, Hopper, for
    decoding shapes with 32 or more query rows per kv head and head dims up to 128), "simt"
    (CUDA cores) on an NVIDIA GPU, "cpu" on the host. Reads only shapes and dtypes (arrays or
    jax.ShapeDtypeStruct) and the kernel switches in the environment now (kernel_switches);
    assumes the default scale; contiguous inputs as XLA lays them out are assumed."""
    device, dtype_code = _kernel_query(query, device)
    if device.platform == "cpu":
        return "cpu"
    *lead, t, n, h = query.shape
    decode_floats = _decode_floats(query, key, bias is not None, mask is not None)
    return _ext.cuda_forward_kernel(device.local_hardware_id, dtype_code, h,
                                    key.shape[-3], bias is not None, mask is not None,
                                    math.prod(lead), t, n, key.shape[-2], decode_floats,
                                    *kernel_switches())


def decode_layout(query, key, *, key_value_seq_lengths=False, device=None) -> tuple[int, str]:
    """(splits, merge) of a call without bias or mask on `device` (default: the first JAX
    device) that takes a split-KV decode kernel ("decode", "decode_sm90"): its key ranges per
    (batch entry, kv head), and "cluster" where they merge inside their thread block cluster
    (compute capability 9.0+, at most 8 blocks per cluster, every cluster resident at once),
    "paired_cluster" where each block runs two splits (one per warpgroup, "decode_sm90" only)
    and the blocks merge them in their cluster, or "combine" where they merge through a second
    kernel; (0, "") for any other call.
    `key_value_seq_lengths`: whether the call passes them (it then aims at more splits). Shapes
    and dtypes only, as forward_kernel."""
    device, dtype_code = _kernel_query(query, device)
    if device.platform == "cpu":
        return 0, ""
    *lead, t, n, h = query.shape
    decode_floats = _decode_floats(query, key, False, False)
    splits, merge = _ext.cuda_decode_layout(device.local_hardware_id, dtype_code, h,
                                            key.shape[-3], math.prod(lead), t, n, key.shape[-2],
                                            bool(key_value_seq_lengths), decode_floats,
                                            kernel_switches().disable_sm90)
    return int(splits), merge


def backward_kernel(query, key, bias=None, mask=None, *, deterministic=False,
                    device=None) -> str:
    """Which backward kernel family the gradient of `attention` runs for these inputs on
    `device` (default: the first JAX device): "sm90" (TMA + wgmma, Hopper), "sm80" (mma.sync),
    "simt" (CUDA cores) on an NVIDIA GPU, "cpu" on the host. `deterministic` is attention's
    `deterministic_backward`. Reads only shapes and dtypes (arrays or jax.ShapeDtypeStruct) and
    the kernel switches in the environment now; assumes the default scale; contiguous inputs as
    XLA lays them out are assumed."""
    device, dtype_code = _kernel_query(query, device)
    if device.platform == "cpu":
        return "cpu"
    *lead, t, n, h = query.shape
    return _ext.cuda_backward_kernel(device.local_hardware_id, dtype_code, h,
                                     key.shape[-3], bias is not None, mask is not None,
                                     bool(deterministic), math.prod(lead), t, n, key.shape[-2],
                                     *kernel_switches())
