"""Packed sequences (segment ids) on the CUDA kernels (run with `pytest -m gpu` on a GPU).

Calls with segment ids take the Hopper kernels' instantiations for them on an H100/H200
(without a bias or mask; the backward with dQ by atomics), the mma.sync family's (bf16/fp16; K/V
by TMA on Hopper, by cp.async elsewhere or with JAX_FLASHATTN_SM80_CP_ASYNC; both dQ modes) and
the CUDA-core kernels (float32, other head dims); decoding shapes take the split-KV decode
kernels' instantiations for the elementwise terms. The tests run each case on the Hopper kernels
and, with JAX_FLASHATTN_DISABLE_SM90, on the mma.sync family.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from helpers import check_cuda_forward, hopper, random_qkv, use_family
from jax_flashattn import _ffi, _ops, segments
from test_gpu_backward import check_grads

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["sm90", "sm80_tma", "sm80_cp_async"])
def family(request, monkeypatch):
    """The forward family a case runs on: the Hopper kernel (skipped off Hopper), or the
    mma.sync one with K/V by TMA (cp.async off Hopper) or by cp.async."""
    return use_family(request.param, monkeypatch)


def check_forward_on(family, q, k, v, *args, **kwargs):
    """check_cuda_forward, after asserting that a bf16/fp16 call takes `family`."""
    if q.dtype != jnp.float32 and q.shape[-1] % 8 == 0:
        ids = {name: kwargs[name] for name in ("query_segment_ids", "key_value_segment_ids")}
        assert jax_flashattn.forward_kernel(q, k, *args[:2], **ids) == family
    check_cuda_forward(q, k, v, *args, **kwargs)


def packed_ids(rng, batch, length, mean):
    """int32 [batch, length]: rows packed with documents of random lengths (exponential with
    the given mean, at least 1), the last one cut at the row's end."""
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < length:
            lengths.append(max(1, int(rng.exponential(mean))))
            total += lengths[-1]
        rows.append(np.asarray(jax_flashattn.segment_ids_from_lengths(np.array(lengths),
                                                                      length)))
    return jnp.asarray(np.stack(rows), jnp.int32)


def ids_for(rng, b, t, s, mean):
    """Query and key ids: the same packing when T == S, separate ones otherwise."""
    q_ids = packed_ids(rng, b, t, mean)
    return q_ids, q_ids if s == t else packed_ids(rng, b, s, mean)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_head_dims(rng, family, dtype, head_dim, is_causal):
    q, k, v = random_qkv(rng, 2, 300, 300, 4, 2, head_dim, dtype)
    q_ids, kv_ids = ids_for(rng, 2, 300, 300, 40)
    check_forward_on(family, q, k, v, is_causal=is_causal, query_segment_ids=q_ids,
                     key_value_segment_ids=kv_ids)


@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_forward_float32(rng, head_dim):
    q, k, v = random_qkv(rng, 2, 300, 300, 4, 2, head_dim, jnp.float32)
    q_ids, kv_ids = ids_for(rng, 2, 300, 300, 40)
    check_cuda_forward(q, k, v, is_causal=True, query_segment_ids=q_ids,
                       key_value_segment_ids=kv_ids)


# One query against 255 keys: below the split-KV decode kernels' 256 (kDecodeMinKeys), so
# the call stays on `family`.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t,s", [(1, 1), (1, 255), (257, 513), (513, 129)])
def test_forward_sizes_and_loads(rng, family, dtype, t, s):
    q, k, v = random_qkv(rng, 2, t, s, 4, 1, 128, dtype)
    q_ids, kv_ids = ids_for(rng, 2, t, s, 50)
    check_forward_on(family, q, k, v, query_segment_ids=q_ids, key_value_segment_ids=kv_ids)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_skips_tiles_between_documents(rng, family, dtype, head_dim, is_causal):
    """Documents longer than a warp's rows and a key tile: each block visits only its
    documents' key tiles, tiles inside one document take no element test (and the settled
    row maxima), the tiles straddling a document boundary do."""
    q, k, v = random_qkv(rng, 2, 1100, 1100, 4, 2, head_dim, dtype)
    q_ids, kv_ids = ids_for(rng, 2, 1100, 1100, 250)
    check_forward_on(family, q, k, v, is_causal=is_causal, query_segment_ids=q_ids,
                     key_value_segment_ids=kv_ids)


# T = S = 1101 over four batch entries: entry b's ids start (b * 1101) % 4 = b ids past the
# 16-byte boundary that the Hopper kernels' id boxes start at (each K or Q tile's ids land in
# shared memory from there), so every offset into a box is read.
OFFSETS_B, OFFSETS_T = 4, 1101


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_reads_ids_at_every_offset_into_their_boxes(rng, family, head_dim, is_causal):
    """Documents longer than a tile (the one-document vote) and boundaries inside tiles (the
    element test), at each of the four offsets."""
    q, k, v = random_qkv(rng, OFFSETS_B, OFFSETS_T, OFFSETS_T, 4, 2, head_dim, jnp.bfloat16)
    ids = packed_ids(rng, OFFSETS_B, OFFSETS_T, 300)
    check_forward_on(family, q, k, v, is_causal=is_causal, query_segment_ids=ids,
                     key_value_segment_ids=ids)


def option_case(rng, case, b, t, s):
    """(query ids, key ids, attention options) of a named case, for T, S >= 401:
    "long_documents" (longer than the tiles: tiles inside one document take no element test);
    "window_lengths_gqa" (a causal window and per-batch lengths, T != S packed apart);
    "unsorted" (ids in no order: tiles of every document interleave); "keyless_rows" (causal;
    each 64 rows an id of their own, the keys, 96 to an id, carry only the even ones: whole
    warpgroups of the forward see no key, rows get zero gradients, key blocks meet no
    query)."""
    if case == "long_documents":
        return (*ids_for(rng, b, t, s, 300), {})
    if case == "window_lengths_gqa":
        lengths = dict(query_seq_lengths=jnp.array([t, 333], jnp.int32),
                       key_value_seq_lengths=jnp.array([s, 401], jnp.int32))
        return (*ids_for(rng, b, t, s, 120),
                dict(is_causal=True, local_window_size=(200, 0), **lengths))
    if case == "unsorted":
        return (jnp.asarray(rng.integers(0, 4, (b, t)), jnp.int32),
                jnp.asarray(rng.integers(0, 4, (b, s)), jnp.int32), {})
    assert case == "keyless_rows", case
    return (jnp.asarray(np.broadcast_to(np.arange(t) // 64, (b, t)), jnp.int32),
            jnp.asarray(np.broadcast_to(np.arange(s) // 96 * 2, (b, s)), jnp.int32),
            dict(is_causal=True))


OPTION_CASES = ["long_documents", "window_lengths_gqa", "unsorted", "keyless_rows"]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", OPTION_CASES)
def test_forward_with_other_options(rng, family, head_dim, case):
    """option_case's cases with GQA, T = 701 against S = 903 (the second entry's ids 1 and 3
    past a 16-byte boundary)."""
    q, k, v = random_qkv(rng, 2, 701, 903, 8, 2, head_dim, jnp.bfloat16)
    q_ids, kv_ids, kwargs = option_case(rng, case, 2, 701, 903)
    check_forward_on(family, q, k, v, query_segment_ids=q_ids, key_value_segment_ids=kv_ids,
                     **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_forward_with_every_option(rng, dtype):
    """Segment ids with a window, lengths, GQA, a bias and a mask at once, on random ids that
    are not sorted (ids repeat across the row, so tiles of different documents interleave)."""
    b, t, s = 2, 200, 230
    q, k, v = random_qkv(rng, b, t, s, 8, 2, 64, dtype)
    q_ids = jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32)
    kv_ids = jnp.asarray(rng.integers(0, 3, (b, s)), jnp.int32)
    bias = jnp.asarray(rng.standard_normal((1, 8, t, s)), dtype)
    mask = jnp.asarray(rng.random((b, 1, t, s)) > 0.2)
    check_cuda_forward(q, k, v, bias, mask, local_window_size=(60, 10),
                       query_seq_lengths=jnp.array([200, 77], jnp.int32),
                       key_value_seq_lengths=jnp.array([150, 230], jnp.int32),
                       query_segment_ids=q_ids, key_value_segment_ids=kv_ids)


def tiles_through_spans(spans, entry, start, width, lo, hi, tile):
    """Tiles of `tile` positions that [lo, hi) holds once narrowed, as the kernels narrow a
    block's range, to the union of batch entry `entry`'s spans over the granules of positions
    [start, start + width)."""
    granule = segments.GRANULE
    union = spans[entry, start // granule:-(-(start + width) // granule)]
    lo = max(lo, int(union[:, 0].min()))
    hi = min(hi, int(union[:, 1].max()))
    return -(-hi // tile) - lo // tile if hi > lo else 0


def assert_order(order, counts):
    """`order` (as the kernel wrote it) takes the long units first in index order (their tile
    counts `counts`, by index, within the longest unit's power-of-two class, __clz(count) - 1,
    and the next two), then the others by class, longest first, in index order within a
    class."""
    classes = [31 - count.bit_length() for count in counts]
    top = min(classes)
    keys = [0 if c < top + 3 else c for c in classes]
    assert len(set(keys)) > 2  # the case sorts something
    assert min(i for i, key in enumerate(keys) if key) < max(i for i, key in enumerate(keys)
                                                            if not key)  # and moves some
    expected = sorted(range(len(counts)), key=lambda i: (keys[i], i))
    # and a sort of every unit by class would differ
    assert expected != sorted(range(len(counts)), key=lambda i: (classes[i], i))
    np.testing.assert_array_equal(np.asarray(order)[:len(counts)], expected)


def test_forward_hands_out_the_short_tiles_last(rng):
    """With segment ids the Hopper forward takes its tiles in the order written into its
    workspace before the launch: the long ones first in the scheduler's own order (a head's
    query blocks together, highest first), then the short ones by key tile count in
    power-of-two classes, longest first (assert_order). Each tile's count is worked out here
    as the kernel's scheduler does, from the spans it narrows to (head dim 128: 128-row query
    blocks, 128-key tiles), causal; the last row is one document, the others hold short ones."""
    if not hopper():
        pytest.skip("the Hopper forward's tile order")
    b, t, n, h, block = 3, 2000, 5, 128, 128
    q, k, v = random_qkv(rng, b, t, t, n, n, h, jnp.bfloat16)
    ids = packed_ids(rng, b, t, 150).at[-1].set(0)
    assert jax_flashattn.forward_kernel(q, k, query_segment_ids=ids,
                                        key_value_segment_ids=ids) == "sm90"
    run = jax.jit(lambda q, k, v, ids: _ops.forward_with_workspaces(
        q, k, v, None, None, None, None, ids, ids, scale=h ** -0.5, window=(None, 0),
        switches=_ffi.kernel_switches()))
    _, _, workspace, _ = run(q, k, v, ids)
    check_cuda_forward(q, k, v, is_causal=True, query_segment_ids=ids,
                       key_value_segment_ids=ids)
    key_spans = np.asarray(segments.spans(ids, ids)[0])
    m = -(-t // block)
    row0 = [(m - 1 - r) * block for r in range(m)]  # query block r, highest first
    counts = [tiles_through_spans(key_spans, i // m // n, row0[i % m], block, 0,
                                  min(row0[i % m] + block, t), block)  # causal
              for i in range(b * n * m)]
    assert_order(np.asarray(workspace)[1:], counts)


def test_backward_runs_the_short_blocks_last(rng):
    """With segment ids the Hopper backward runs its blocks in the order written into its
    workspace before the launch: the long ones first in index order (a kv head's key blocks
    together, lowest first), then the short ones by query tile count in power-of-two classes,
    longest first (assert_order). Each block's count is worked out here as BackwardBlock does,
    from the spans it narrows to (head dim 128: 128-key blocks, 64-query tiles), causal; the
    last row is one document, the first holds short ones."""
    if not hopper():
        pytest.skip("the Hopper backward's block order")
    b, t, n, kv, h, block, tile = 2, 2000, 4, 2, 128, 128, 64
    q, k, v = random_qkv(rng, b, t, t, n, kv, h, jnp.bfloat16)
    ids = packed_ids(rng, b, t, 60).at[-1].set(0)
    assert jax_flashattn.backward_kernel(q, k, query_segment_ids=ids,
                                         key_value_segment_ids=ids) == "sm90"
    options = dict(scale=h ** -0.5, window=(None, 0), switches=_ffi.kernel_switches())

    def run(q, k, v, ids):
        out, lse = _ops.forward(q, k, v, None, None, None, None, ids, ids, **options)
        return _ops.backward_with_workspaces(q, k, v, out, lse, out, None, None, None, None,
                                             ids, ids, **options)[5]

    workspace = jax.jit(run)(q, k, v, ids)
    query_spans = np.asarray(segments.spans(ids, ids)[1])
    m = -(-t // block)
    counts = [tiles_through_spans(query_spans, i // m // kv, i % m * block, block,
                                  i % m * block, t, tile)  # causal
              for i in range(b * kv * m)]
    assert_order(workspace, counts)
    check_grads_on(("sm90", False), rng, q, k, v, is_causal=True, query_segment_ids=ids,
                   key_value_segment_ids=ids)


def test_calls_past_the_orders_capacity(rng):
    """A call of more (batch entry, 128-position block) pairs than the order kernel's shared
    memory holds (44928 beside its 4224 bytes of counts; 46 x 1024 here, under 49152: a cap
    that left the counts out would let it launch past 48 KiB and fail) runs both Hopper
    kernels, without an order: the forward gives each row what a call of that row alone
    (ordered) gives, bit for bit, and the gradients agree with theirs to within the dQ
    additions' order."""
    if not hopper():
        pytest.skip("the Hopper kernels' work order")
    b, t, h = 46, 131072, 128
    # Drawn on the device: 3 x 771M normals take a while on the host.
    keys = jax.random.split(jax.random.PRNGKey(int(rng.integers(2 ** 31))), 3)
    q, k, v = (jax.random.normal(key, (b, t, 1, h), jnp.bfloat16) for key in keys)
    ids = packed_ids(rng, b, t, 100)
    assert jax_flashattn.forward_kernel(q, k, query_segment_ids=ids,
                                        key_value_segment_ids=ids) == "sm90"
    assert jax_flashattn.backward_kernel(q, k, query_segment_ids=ids,
                                         key_value_segment_ids=ids) == "sm90"

    def loss(q, k, v, ids):
        out = jax_flashattn.attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                      key_value_segment_ids=ids)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    run = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, out = run(q, k, v, ids)
    rows = [2, 23, 45]
    for r in rows:
        row = slice(r, r + 1)
        row_grads, row_out = run(q[row], k[row], v[row], ids[row])
        np.testing.assert_array_equal(np.asarray(out[row]), np.asarray(row_out))
        for g, row_g in zip(grads, row_grads):
            g, row_g = np.asarray(g[row], np.float32), np.asarray(row_g, np.float32)
            assert np.abs(g - row_g).max() <= 2 ** -7 * np.abs(row_g).max()


@pytest.mark.parametrize("family", ["default", "sm80"])
@pytest.mark.parametrize("t,n,kv", [(1, 8, 2), (4, 8, 2), (16, 16, 4), (3, 4, 4)],
                         ids=["t1-gqa", "t4-gqa", "t16-gqa", "t3-mha"])
def test_decoding_shapes_take_the_decode_kernels(rng, monkeypatch, family, t, n, kv):
    """A decoding shape (few query rows per kv head, many keys) with segment ids takes a split-KV
    decode kernel ("sm80": the mma.sync one): key documents of random lengths from 1 up, each
    query in one of them or in one no key has (that row sees nothing: 0, lse -inf), an odd S,
    and with the keys' lengths, causal at the bottom right, a bias or a mask beside the ids."""
    if family == "sm80":
        monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    b, s = 2, 4099
    q, k, v = random_qkv(rng, b, t, s, n, kv, 128, jnp.bfloat16)
    kv_ids = np.zeros((b, s), np.int32)
    for row in kv_ids:
        starts = np.sort(rng.choice(np.arange(1, s), size=12, replace=False))
        for start in starts:
            row[start:] += 1
    q_ids = np.stack([rng.choice(row, size=t) for row in kv_ids]).astype(np.int32)
    q_ids[0, -1] = 99  # a document no key has
    ids = dict(query_segment_ids=jnp.asarray(q_ids), key_value_segment_ids=jnp.asarray(kv_ids))
    rows_per_kv_head = t * n // kv
    wgmma = hopper() and family == "default" and rows_per_kv_head >= 32
    expected = "decode_sm90" if wgmma else "decode"
    assert jax_flashattn.forward_kernel(q, k, **ids) == expected
    check_cuda_forward(q, k, v, **ids)
    lengths = np.array([s, 2500], np.int32)
    check_cuda_forward(q, k, v, **ids, key_value_seq_lengths=lengths)
    check_cuda_forward(q, k, v, **ids, is_causal=True, diagonal_alignment="bottom_right")
    bias = jnp.asarray(rng.standard_normal((b, n, t, s)), jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k, bias, **ids) == expected
    check_cuda_forward(q, k, v, bias, **ids)
    mask = jnp.asarray(rng.random((b, 1, t, s)) > 0.25)
    assert jax_flashattn.forward_kernel(q, k, mask=mask, **ids) == expected
    check_cuda_forward(q, k, v, mask=mask, **ids)
    # Every query of the second batch entry in a document no key has: its units' key ranges
    # narrow to nothing, every split is empty, and its rows are 0 with lse -inf.
    q_ids[1] = 99
    check_cuda_forward(q, k, v, query_segment_ids=jnp.asarray(q_ids),
                       key_value_segment_ids=jnp.asarray(kv_ids))


def test_families_with_segment_ids(rng):
    q, k, _ = random_qkv(rng, 2, 512, 512, 8, 8, 128, jnp.bfloat16)
    ids = dict(query_segment_ids=jnp.zeros((2, 512), jnp.int32),
               key_value_segment_ids=jnp.zeros((2, 512), jnp.int32))
    assert jax_flashattn.forward_kernel(q, k, **ids) == ("sm90" if hopper() else "sm80")
    assert jax_flashattn.backward_kernel(q, k, **ids) == ("sm90" if hopper() else "sm80")
    assert jax_flashattn.backward_kernel(q, k, deterministic=True, **ids) == "sm80"
    bias = jnp.zeros((1, 8, 512, 512), jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k, bias, **ids) == "sm80"
    assert jax_flashattn.backward_kernel(q, k, bias, **ids) == "sm80"
    assert jax_flashattn.forward_kernel(q.astype(jnp.float32), k.astype(jnp.float32),
                                        **ids) == "simt"


@pytest.fixture(params=[False, True], ids=["atomic", "deterministic"])
def deterministic(request):
    return request.param


@pytest.fixture(params=["sm90", "sm80_atomic", "sm80_deterministic"])
def backward_family(request, monkeypatch):
    """(family, deterministic): the Hopper backward (skipped off Hopper), or the mma.sync one
    with dQ by atomics or by its own pass."""
    return use_family(request.param, monkeypatch), request.param.endswith("deterministic")


def check_grads_on(backward_family, rng, q, k, v, **kwargs):
    """check_grads on the backward family, asserted."""
    family, deterministic = backward_family
    ids = {name: kwargs[name] for name in ("query_segment_ids", "key_value_segment_ids")}
    assert jax_flashattn.backward_kernel(q, k, deterministic=deterministic,
                                         **ids) == family
    return check_grads(rng, q, k, v, deterministic=deterministic, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward(rng, backward_family, dtype, head_dim, is_causal):
    q, k, v = random_qkv(rng, 2, 300, 300, 4, 2, head_dim, dtype)
    q_ids, kv_ids = ids_for(rng, 2, 300, 300, 40)
    check_grads_on(backward_family, rng, q, k, v, is_causal=is_causal, query_segment_ids=q_ids,
                   key_value_segment_ids=kv_ids)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_reads_ids_at_every_offset_into_their_boxes(rng, backward_family, head_dim,
                                                             is_causal):
    """test_forward_reads_ids_at_every_offset_into_their_boxes's calls, differentiated: the
    Hopper backward's query ids land beside each Q tile."""
    q, k, v = random_qkv(rng, OFFSETS_B, OFFSETS_T, OFFSETS_T, 4, 2, head_dim, jnp.bfloat16)
    ids = packed_ids(rng, OFFSETS_B, OFFSETS_T, 300)
    check_grads_on(backward_family, rng, q, k, v, is_causal=is_causal, query_segment_ids=ids,
                   key_value_segment_ids=ids)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", OPTION_CASES)
def test_backward_cases(rng, backward_family, head_dim, case):
    """option_case's cases with GQA, T = 701 against S = 903 (the second entry's ids 1 and 3
    past a 16-byte boundary)."""
    q, k, v = random_qkv(rng, 2, 701, 903, 8, 2, head_dim, jnp.bfloat16)
    q_ids, kv_ids, kwargs = option_case(rng, case, 2, 701, 903)
    check_grads_on(backward_family, rng, q, k, v, query_segment_ids=q_ids,
                   key_value_segment_ids=kv_ids, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_backward_with_every_option(rng, dtype, deterministic):
    """Gradients (dbias too) with T != S, different packings, GQA, a window, lengths, a bias and
    a mask."""
    b, t, s = 2, 190, 257
    q, k, v = random_qkv(rng, b, t, s, 8, 2, 64, dtype)
    q_ids, kv_ids = ids_for(rng, b, t, s, 30)
    bias = jnp.asarray(rng.standard_normal((1, 8, t, s)), jnp.float32)
    mask = jnp.asarray(rng.random((b, 1, t, s)) > 0.1)
    check_grads(rng, q, k, v, bias, mask, is_causal=True, local_window_size=(90, 0),
                query_seq_lengths=jnp.array([190, 100], jnp.int32),
                key_value_seq_lengths=jnp.array([257, 120], jnp.int32),
                deterministic=deterministic, query_segment_ids=q_ids,
                key_value_segment_ids=kv_ids)


def test_rows_of_unshared_segments_are_zero(rng):
    """Queries whose id no key carries see nothing: out 0, lse -inf, zero gradients."""
    q, k, v = random_qkv(rng, 1, 130, 130, 4, 4, 64, jnp.bfloat16)
    q_ids = jnp.asarray(np.repeat([[0, 5]], 65, axis=1), jnp.int32)
    kv_ids = jnp.zeros((1, 130), jnp.int32)
    out, lse = jax_flashattn.attention(q, k, v, query_segment_ids=q_ids,
                                       key_value_segment_ids=kv_ids, return_residual=True)
    hidden = np.asarray(q_ids[0]) == 5
    assert np.all(np.asarray(out, np.float32)[0, hidden] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[0, hidden]))
    dq = check_grads(rng, q, k, v, query_segment_ids=q_ids, key_value_segment_ids=kv_ids)[0]
    assert np.all(np.asarray(dq, np.float32)[0, hidden] == 0)
