"""Values whose gradient raises a TypeError saying why: the forward-only calls (paged
attention, FP8 attention) pass their operands or results through these, so that jax.grad
stops with their own message instead of differentiating what their kernels do not."""

from __future__ import annotations

import functools

import jax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def call(message: str, fn, *xs):
    """fn(*xs), whose gradient raises TypeError(message)."""
    return fn(*xs)


def _call_fwd(message, fn, *xs):
    return fn(*xs), None


def _call_bwd(message, fn, _, g):
    raise TypeError(message)


call.defvjp(_call_fwd, _call_bwd)


def _identity(x):
    return x


def identity(message: str, x):
    """x, whose gradient raises TypeError(message)."""
    return call(message, _identity, x)
