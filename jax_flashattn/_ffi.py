"""Loads the compiled extension and registers its FFI handlers with XLA, once, on import."""

from __future__ import annotations

import jax

from jax_flashattn import _jax_flashattn as _ext

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
