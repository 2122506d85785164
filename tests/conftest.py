"""Test setup: 8 host CPU devices for the sharding tests, no GPU memory preallocation or XLA
autotuning under pytest-xdist, and the `gpu` marker's skipping."""

import os

# Must be set before jax initialises its CPU backend; harmless on GPU runs.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

# Every pytest-xdist worker is a process of its own on the one GPU: with XLA's default, each
# would reserve 75% of the GPU's memory at its first allocation and the others would run out.
# Without preallocation XLA's allocator still reuses freed blocks, which `helpers.poison` needs.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # Nor does each worker autotune XLA's own GPU kernels (the references', cuDNN's): the
    # candidates' timings on a GPU shared by every worker mean little, and the tests compare
    # results within error budgets that no algorithm choice comes near. (Ignored on a CPU.)
    if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_flashattn  # noqa: E402


def gpu_available() -> bool:
    return jax.default_backend() == "gpu" and jax_flashattn.cuda_built()


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and jax_flashattn built with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed on failure so a run can be replayed."""
    seed = int(os.environ.get("JAX_FLASHATTN_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
