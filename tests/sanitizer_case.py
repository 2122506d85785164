"""Small forward and backward calls of every CUDA kernel family, for compute-sanitizer.

    compute-sanitizer --tool memcheck --kernel-name kns=jax_flashattn python3 tests/sanitizer_case.py
    compute-sanitizer --tool racecheck --kernel-name kns=jax_flashattn python3 tests/sanitizer_case.py

Under memcheck the process has crashed inside XLA's compilation of a later case, not in a
kernel (a segfault after a "Very slow compile" warning: twice on an H100 with jax 0.11.2, after
2 and after 5 of the 11 cases). Compiling without autotuning, on one thread and without command
buffers runs every case to the end:

    XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_force_compilation_parallelism=1 \
    --xla_gpu_enable_command_buffer=" compute-sanitizer --tool memcheck ...

Shapes are odd (tile edges), with GQA, causal, windows, lengths (bottom-right aligned at them
too), soft-caps, biases and masks (with dbias), ALiBi (with the slopes' gradient), so every
predicated path runs (and two long forwards take the wide Hopper tiles of head dims 128 and
64), and the tensor-core backward runs in both dQ modes (atomics and deterministic); the
script exits non-zero if a result is not finite (or, for the paged calls with a bad page
id, not NaN where it should be).
"""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn
from helpers import random_qkv  # tests/ is this script's directory, so it is on sys.path


def main():
    rng = np.random.default_rng(0)
    lens = jnp.array([37, 0], jnp.int32)
    q_lens = jnp.array([60, 77], jnp.int32)
    cases = [
        (jnp.bfloat16, 128, dict(is_causal=True)),
        (jnp.float16, 72, dict(local_window_size=(20, 5), key_value_seq_lengths=lens)),
        (jnp.bfloat16, 256, dict(query_seq_lengths=lens)),
        # Head dim 256 on the Hopper kernel: 64-key tiles, so the lower warpgroup of a causal
        # query block skips the block's last key tile (its tail).
        (jnp.bfloat16, 256, dict(is_causal=True)),
        (jnp.float32, 36, dict(is_causal=True)),
        (jnp.bfloat16, 64, dict(bias=np.ones((4, 77, 1), np.float32),
                                mask=np.arange(93) % 3 != 1, is_causal=True)),
        # The tensor-core backward's deterministic mode (the cases above use its atomics): on
        # Hopper the Hopper kernel's ordered dQ additions, with a bias broadcast over the keys
        # and elsewhere the mma.sync family's dQ pass.
        (jnp.bfloat16, 128, dict(is_causal=True, deterministic_backward=True)),
        (jnp.float16, 96, dict(local_window_size=(20, 5), query_seq_lengths=lens,
                               deterministic_backward=True)),
        (jnp.bfloat16, 32, dict(bias=np.ones((4, 77, 1), np.float32),
                                mask=np.arange(93) % 3 != 1, deterministic_backward=True)),
        # Head dims above 128 in deterministic mode: on Hopper the Hopper backward at 256 (dQ
        # added by each thread in the tile's turn), elsewhere the mma.sync backward's large table
        # (136 padded to 192, the deterministic dQ pass's 16-key tiles; the H = 256 cases above
        # run its atomic mode there).
        (jnp.float16, 136, dict(is_causal=True, key_value_seq_lengths=lens,
                                deterministic_backward=True)),
        # Segment ids (on Hopper the Hopper forward's kernel for them, elsewhere the mma.sync
        # forward's; the mma.sync backward's).
        (jnp.bfloat16, 128, dict(is_causal=True, key_value_seq_lengths=lens,
                                 query_segment_ids=np.arange(2 * 77).reshape(2, 77) // 20,
                                 key_value_segment_ids=np.arange(2 * 93).reshape(2, 93) // 25)),
        # Soft-capped logits: on Hopper the Hopper kernels' instantiations for them (head dims
        # 128 and 256, the backward in both dQ modes), elsewhere and with a bias or mask the
        # mma.sync family's; the CUDA-core kernels for float32.
        (jnp.bfloat16, 128, dict(is_causal=True, key_value_seq_lengths=lens,
                                 logits_soft_cap=5.0)),
        (jnp.float16, 256, dict(local_window_size=(20, 5), logits_soft_cap=5.0,
                                deterministic_backward=True)),
        (jnp.bfloat16, 64, dict(bias=np.ones((4, 77, 1), np.float32),
                                mask=np.arange(93) % 3 != 1, logits_soft_cap=3.0)),
        (jnp.float32, 36, dict(is_causal=True, logits_soft_cap=5.0)),
        # A bias and mask at unit stride along the keys: on Hopper the Hopper kernels'
        # instantiations for them (dbias summed over the batch by atomic adds; then one writer
        # per element under a window), elsewhere the mma.sync family's.
        (jnp.bfloat16, 128, dict(bias=np.ones((4, 77, 93), np.float32),
                                 mask=np.arange(93) % 3 != 1, is_causal=True)),
        (jnp.float16, 64, dict(bias=np.ones((2, 4, 77, 93), np.float32),
                               local_window_size=(20, 5), key_value_seq_lengths=lens)),
        # Bottom-right alignment with seq lengths (each entry's window moved by its own
        # kv_len - q_len; an entry with more queries than keys): the tensor-core families in
        # both dQ modes and the CUDA-core kernels.
        (jnp.bfloat16, 128, dict(is_causal=True, query_seq_lengths=q_lens,
                                 key_value_seq_lengths=lens, diagonal_alignment="bottom_right")),
        (jnp.float16, 64, dict(local_window_size=(20, 5), query_seq_lengths=q_lens,
                               diagonal_alignment="bottom_right", deterministic_backward=True)),
        (jnp.float32, 36, dict(is_causal=True, key_value_seq_lengths=lens,
                               diagonal_alignment="bottom_right")),
    ]
    for dtype, head_dim, kwargs in cases:
        q, k, v = random_qkv(rng, 2, 77, 93, 4, 2, head_dim, dtype)

        def loss(q, k, v):
            out = jax_flashattn.attention(q, k, v, implementation="cuda", **kwargs)
            return jnp.sum(out.astype(jnp.float32))

        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for x in (value, *grads):
            assert np.isfinite(np.asarray(x, np.float32)).all(), (dtype, head_dim, kwargs)
        print(f"ok: {jnp.dtype(dtype).name} H={head_dim} {sorted(kwargs)}")

    # dbias (the cases above take no gradient of their bias), from the tensor-core backward:
    # summed over the batch by atomic adds, then one writer per element under a window, then
    # deterministic (the full dbias, one writer per element; on Hopper dQ in the tiles' turns).
    for bias_shape, kwargs in [((4, 77, 93), dict(is_causal=True, mask=np.arange(93) % 3 != 1)),
                               ((2, 4, 77, 93), dict(local_window_size=(20, 5),
                                                     key_value_seq_lengths=lens)),
                               ((4, 77, 93), dict(is_causal=True, mask=np.arange(93) % 3 != 1,
                                                  deterministic_backward=True))]:
        q, k, v = random_qkv(rng, 2, 77, 93, 4, 2, 128, jnp.bfloat16)

        def bias_loss(bias):
            out = jax_flashattn.attention(q, k, v, bias, implementation="cuda", **kwargs)
            return jnp.sum(out.astype(jnp.float32))

        dbias = jax.jit(jax.grad(bias_loss))(jnp.ones(bias_shape, jnp.float32))
        assert np.isfinite(np.asarray(dbias)).all(), (bias_shape, kwargs)
        print(f"ok: dbias {bias_shape} {sorted(kwargs)}")

    # A bf16 bias alone (with dbias) and a mask alone on the Hopper backward at head dims 128
    # and 256, each step's tile of it staged beside Q and dO by cp.async (96 keys, a whole
    # number of 16-byte chunks; rows past T zero-filled; the mask with a row per query and
    # with one row for all), in both dQ modes.
    for head_dim, kwargs in [(128, dict(is_causal=True)),
                             (128, dict(key_value_seq_lengths=lens, deterministic_backward=True)),
                             (256, dict(is_causal=True)),
                             (256, dict(query_seq_lengths=lens, deterministic_backward=True))]:
        q, k, v = random_qkv(rng, 2, 77, 96, 4, 2, head_dim, jnp.bfloat16)
        bias = jnp.asarray(rng.standard_normal((1, 4, 77, 96)), jnp.bfloat16)

        def staged_loss(q, bias, mask):
            out = jax_flashattn.attention(q, k, v, bias, mask=mask, implementation="cuda",
                                          **kwargs)
            return jnp.sum(out.astype(jnp.float32))

        keep = np.arange(77 * 96).reshape(77, 96) % 3 != 1
        for term_bias, mask in [(bias, None), (None, keep), (None, keep[0])]:
            argnums = (0, 1) if term_bias is not None else (0,)
            grads = jax.jit(jax.grad(staged_loss, argnums=argnums))(q, term_bias, mask)
            for x in grads:
                assert np.isfinite(np.asarray(x, np.float32)).all(), kwargs
        print(f"ok: staged bias and mask, backward H={head_dim} {sorted(kwargs)}")

    # A mask of documents that hides whole tiles: each block narrowed to the mask's spans (a
    # block or warpgroup that sees no key through them idles), staged (304 keys) and read from
    # global memory (301), causal and not, in the forward and both backward dQ modes.
    for head_dim, s, kwargs in [(128, 304, dict(is_causal=True)), (64, 301, {}),
                                (256, 304, dict(deterministic_backward=True)),
                                (128, 301, dict(deterministic_backward=True, is_causal=True))]:
        q, k, v = random_qkv(rng, 2, 200, s, 4, 2, head_dim, jnp.bfloat16)
        documents = (np.arange(200) // 70)[:, None] == (np.arange(s) // 100)[None, :]

        def documents_loss(q, k, v):
            out = jax_flashattn.attention(q, k, v, mask=documents, implementation="cuda",
                                          **kwargs)
            return jnp.sum(out.astype(jnp.float32))

        value, grads = jax.jit(jax.value_and_grad(documents_loss, argnums=(0, 1, 2)))(q, k, v)
        for x in (value, *grads):
            assert np.isfinite(np.asarray(x, np.float32)).all(), (head_dim, s, kwargs)
        print(f"ok: documents mask H={head_dim} S={s} {sorted(kwargs)}")

    # ALiBi and its slopes' gradient (partial sums in slots, one writer each): on Hopper the
    # Hopper kernels' instantiations for the terms (both dQ modes), elsewhere and beside a
    # soft-cap the mma.sync family's; the CUDA-core kernels for float32.
    for dtype, head_dim, kwargs in [
            (jnp.bfloat16, 128, dict(is_causal=True, key_value_seq_lengths=lens)),
            (jnp.float16, 64, dict(local_window_size=(20, 5), query_seq_lengths=q_lens,
                                   diagonal_alignment="bottom_right",
                                   deterministic_backward=True)),
            (jnp.bfloat16, 256, dict(bias=np.ones((4, 77, 93), np.float32), is_causal=True)),
            (jnp.bfloat16, 64, dict(logits_soft_cap=3.0, is_causal=True)),
            (jnp.float32, 36, dict(is_causal=True, key_value_seq_lengths=lens))]:
        q, k, v = random_qkv(rng, 2, 77, 93, 4, 2, head_dim, dtype)

        def alibi_loss(q, slopes):
            out = jax_flashattn.attention(q, k, v, implementation="cuda", alibi_slopes=slopes,
                                          **kwargs)
            return jnp.sum(out.astype(jnp.float32))

        slopes = jnp.asarray(2.0 ** -rng.uniform(1, 8, (2, 4)), jnp.float32)
        grads = jax.jit(jax.grad(alibi_loss, argnums=(0, 1)))(q, slopes)
        for x in grads:
            assert np.isfinite(np.asarray(x, np.float32)).all(), (dtype, head_dim, kwargs)
        print(f"ok: alibi {jnp.dtype(dtype).name} H={head_dim} {sorted(kwargs)}")

    # The split-KV decode kernel: 3 queries, GQA 4:1, 1000 odd keys, lengths. 4 splits per kv
    # head, which on Hopper merge in their thread block cluster (distributed shared memory);
    # 4097 keys give 17, which merge through the workspace and the combine kernel.
    forward_case(rng, "decode", (2, 3, 1001, 8, 2, 128), kernel="decode",
                 is_causal=True, key_value_seq_lengths=jnp.array([1001, 300], jnp.int32))
    forward_case(rng, "decode, combine", (2, 3, 4097, 8, 2, 128), kernel="decode",
                 key_value_seq_lengths=jnp.array([4097, 300], jnp.int32))
    # 64 query rows per block (16 queries, GQA 4:1): on Hopper the wgmma decode kernel (unless
    # JAX_FLASHATTN_DISABLE_SM90), elsewhere the mma.sync one; head dim 72 zero-filled to 128,
    # 1001 odd keys, lengths.
    forward_case(rng, "decode, 64 rows", (2, 16, 1001, 8, 2, 72),
                 kernel=("decode", "decode_sm90"),
                 key_value_seq_lengths=jnp.array([1001, 300], jnp.int32))
    # The decode preset's 64 kv heads at 64 rows per block with 4 splits: on Hopper with 128+
    # SMs the wgmma kernel's two splits per block (one ring and named barrier per warpgroup),
    # merged in clusters of 2; lengths leave warpgroups, blocks and a whole unit without keys.
    forward_case(rng, "decode, paired splits", (8, 16, 1024, 32, 8, 128),
                 kernel=("decode", "decode_sm90"),
                 key_value_seq_lengths=jnp.array([1024, 0, 1, 300, 700, 555, 1023, 64],
                                                 jnp.int32))
    # Soft-capped decoding calls on the decode kernels' instantiations for the cap: 64 rows per
    # block (the wgmma kernel on Hopper) with lengths, and 12 rows with 4097 keys (the mma.sync
    # kernel, with as many splits as the uncapped "decode, combine" case above).
    forward_case(rng, "decode, soft-capped", (2, 16, 1001, 8, 2, 128),
                 kernel=("decode", "decode_sm90"), logits_soft_cap=5.0,
                 key_value_seq_lengths=jnp.array([1001, 300], jnp.int32))
    forward_case(rng, "decode, soft-capped, combine", (2, 3, 4097, 8, 2, 64), kernel="decode",
                 logits_soft_cap=5.0)
    # A serving bias and a cache's mask on the decode kernels' instantiations for them: 64 rows
    # per block (the wgmma kernel on Hopper) with lengths, and 12 rows with 4097 keys (the
    # mma.sync kernel, the combine); each thread reads only the keys its rows see.
    forward_case(rng, "decode, bias and mask", (2, 16, 1001, 8, 2, 128),
                 kernel=("decode", "decode_sm90"), bias=np.ones((2, 8, 1, 1001), np.float32),
                 mask=np.arange(1001) % 3 != 1,
                 key_value_seq_lengths=jnp.array([1001, 300], jnp.int32))
    forward_case(rng, "decode, bias, combine", (2, 3, 4097, 8, 2, 64), kernel="decode",
                 bias=np.ones((8, 3, 4097), np.float16))
    # The same terms the same for every query, at unit stride and in whole 16-byte pieces:
    # copied with each K/V tile into shared memory (decode_terms_stage: 4 rows of a bf16 bias
    # and a mask, 768 of the mma.sync kernel's 1024 bytes a stage), the pieces past S
    # zero-filled, those past the lengths' keys read and hidden after; 4 rows (the mma.sync
    # kernel) and 64 (on Hopper the wgmma kernel).
    forward_case(rng, "decode, staged bias and mask", (2, 1, 1040, 8, 2, 128), kernel="decode",
                 bias=np.ones((2, 8, 1, 1040), jnp.bfloat16),
                 mask=np.arange(1040) % 3 != 1,
                 key_value_seq_lengths=jnp.array([1040, 300], jnp.int32))
    forward_case(rng, "decode, staged bias, 64 rows", (2, 16, 1040, 8, 2, 128),
                 kernel=("decode", "decode_sm90"), bias=np.ones((2, 8, 1, 1040), np.float32),
                 key_value_seq_lengths=jnp.array([1040, 300], jnp.int32))
    # ALiBi on the decode kernels' instantiations for the terms: each packed row with its
    # head's slope and its query's diagonal.
    forward_case(rng, "decode, alibi", (2, 16, 1001, 8, 2, 128),
                 kernel=("decode", "decode_sm90"), is_causal=True,
                 diagonal_alignment="bottom_right",
                 alibi_slopes=jnp.asarray(2.0 ** -rng.uniform(1, 8, (2, 8)), jnp.float32),
                 key_value_seq_lengths=jnp.array([1001, 300], jnp.int32))
    forward_case(rng, "decode, alibi, combine", (2, 3, 4097, 8, 2, 64), kernel="decode",
                 alibi_slopes=jnp.asarray(2.0 ** -rng.uniform(1, 8, (8,)), jnp.float32))
    # A bf16 bias alone and a mask alone, staged by each warp in shared memory by cp.async
    # (keys a whole number of 16-byte chunks; the last tile's chunks past S zero-filled).
    for head_dim in (64, 128):
        forward_case(rng, f"staged bias, H={head_dim}", (2, 300, 704, 4, 2, head_dim),
                     kernel=("sm90", "sm80"), is_causal=True,
                     bias=jnp.asarray(rng.standard_normal((1, 4, 300, 704)), jnp.bfloat16),
                     query_seq_lengths=jnp.array([300, 41], jnp.int32))
        forward_case(rng, f"staged mask, H={head_dim}", (2, 300, 704, 4, 2, head_dim),
                     kernel=("sm90", "sm80"), mask=np.arange(704) % 3 != 1)
    # ALiBi alone on the Hopper kernel, which visits a block's key tiles from its diagonal on:
    # the last key tile, whose V rows past a length are zeroed before it is read, falls in the
    # middle of the order; at head dim 256 O is staged in the K/V ring after the key tiles.
    for head_dim, kwargs in [(128, dict(key_value_seq_lengths=jnp.array([1001, 517], jnp.int32))),
                             (256, dict(is_causal=True, diagonal_alignment="bottom_right",
                                        query_seq_lengths=jnp.array([650, 200], jnp.int32),
                                        key_value_seq_lengths=jnp.array([777, 390],
                                                                        jnp.int32)))]:
        forward_case(rng, f"alibi alone, long rows, H={head_dim}", (2, 700, 1001, 4, 2, head_dim),
                     kernel=("sm90", "sm80"),
                     alibi_slopes=jnp.asarray(2.0 ** -rng.uniform(1, 8, (2, 4)), jnp.float32),
                     **kwargs)
    # Decoding with bottom-right alignment at each entry's lengths: a causal window whose
    # per-entry shift moves the split's key range.
    forward_case(rng, "decode, bottom-right at the lengths", (2, 16, 1001, 8, 2, 128),
                 kernel=("decode", "decode_sm90"), is_causal=True, local_window_size=(400, 0),
                 query_seq_lengths=jnp.array([16, 5], jnp.int32),
                 key_value_seq_lengths=jnp.array([1001, 300], jnp.int32),
                 diagonal_alignment="bottom_right")
    # Forward with S >= 16384 and no causal or window bound (the Hopper kernel's 160-key tiles
    # and single Q buffer): 3 x 64 query tiles, more than the SMs, so blocks reuse the buffer.
    forward_case(rng, "wide key tiles", (1, 300, 16500, 64, 8, 128))
    # Head dim 64, T >= 512 (the Hopper kernel's three consumer warpgroups on 192-row tiles,
    # four K/V stages), causal: 11 query tiles x 16 heads, more than the SMs, so the ring of
    # four wraps across a block's tiles; T ends mid-tile.
    forward_case(rng, "three consumer warpgroups", (1, 2100, 2100, 16, 4, 64), is_causal=True)
    # Head dim 64 below T = 512 (two consumer warpgroups, three K/V stages, each next tile's Q
    # issued ahead), causal: 4 query tiles x 48 heads, more than the SMs, so the ring of three
    # wraps across a block's tiles; T ends mid-tile.
    forward_case(rng, "three K/V stages", (1, 400, 400, 48, 8, 64), is_causal=True)
    # Head dim 256 on the Hopper kernel, O staged in the K/V stage the ring lends after each
    # query block's key tiles: 3 x 64 query tiles (more than the SMs), so a block's next
    # tile loads K/V into the stage its last tile's O was stored from; T ends mid-tile.
    forward_case(rng, "O in the K/V ring", (1, 300, 300, 64, 8, 256), is_causal=True)
    # Key lengths inside a key tile under a window that reaches one tile further for the upper
    # warpgroup of a query block: the first warpgroup that reads the tile holding the length
    # zeroes its V rows past it (the lower one in some blocks, the upper in others), which the
    # other reads after their turns; and the mma.sync family's TMA loads do the same.
    lengths_case = dict(local_window_size=(90, 40),
                        key_value_seq_lengths=jnp.array([238, 700], jnp.int32))
    forward_case(rng, "lengths inside a key tile", (2, 300, 700, 4, 2, 128), **lengths_case)
    with switch("JAX_FLASHATTN_DISABLE_SM90"):
        forward_case(rng, "lengths inside a key tile, mma.sync", (2, 300, 700, 4, 2, 128),
                     **lengths_case)
    # The same with bottom-right alignment at each entry's lengths: the Hopper forward's
    # consumers move the window to each tile's entry (two entries, shifts 400 and -62).
    aligned_case = dict(lengths_case, query_seq_lengths=jnp.array([300, 300], jnp.int32),
                        diagonal_alignment="bottom_right")
    forward_case(rng, "bottom-right at the lengths", (2, 300, 700, 4, 2, 128), **aligned_case)
    forward_case(rng, "bottom-right at the lengths, causal", (2, 300, 700, 4, 2, 64),
                 is_causal=True, query_seq_lengths=jnp.array([300, 100], jnp.int32),
                 key_value_seq_lengths=jnp.array([238, 700], jnp.int32),
                 diagonal_alignment="bottom_right")
    # Segment ids, causal, with key lengths: 64-row halves of query blocks whose documents no
    # key carries (idle warpgroups), key tiles narrowed to each block's documents, tiles inside
    # one document and tiles across a boundary.
    ids_case = dict(is_causal=True, key_value_seq_lengths=jnp.array([700, 333], jnp.int32),
                    query_segment_ids=np.broadcast_to(np.arange(300) // 64, (2, 300)),
                    key_value_segment_ids=np.broadcast_to(np.arange(700) // 96 * 2, (2, 700)))
    forward_case(rng, "segment ids", (2, 300, 700, 4, 2, 128), **ids_case)
    with switch("JAX_FLASHATTN_DISABLE_SM90"):
        forward_case(rng, "segment ids, mma.sync", (2, 300, 700, 4, 2, 128), **ids_case)
    # A bias and a boolean mask on the Hopper forward (WithBiasAndMask; off Hopper the mma.sync
    # family's): each thread's reads of its rows and the prefetches of the next key tile, at
    # query and key tile edges, under a window and key lengths that cross tiles; a float32
    # bias at head dim 128, a bf16 one at 256 (64-key tiles).
    bias_case = dict(local_window_size=(90, 40),
                     key_value_seq_lengths=jnp.array([238, 700], jnp.int32),
                     mask=rng.random((2, 1, 300, 700)) < 0.8)
    forward_case(rng, "bias and mask", (2, 300, 700, 4, 2, 128),
                 bias=rng.standard_normal((1, 4, 300, 700)).astype(np.float32), **bias_case)
    forward_case(rng, "bias and mask, head dim 256", (2, 300, 700, 4, 2, 256),
                 bias=jnp.asarray(rng.standard_normal((2, 1, 300, 700)), jnp.bfloat16),
                 **bias_case)
    # Paged caches read in place by the decode kernels: pages shorter than a key tile (each row
    # from its own page) and holding whole tiles, on the mma.sync kernel (4 rows per block) and
    # on the wgmma one (32 rows on Hopper), under jit with an id past the pool among a
    # sequence's pages (read clamped to the pool, that sequence's rows NaN) and ids past the
    # used pages that must not be read at all.
    for head_dim, page_size, t in [(128, 16, 1), (128, 256, 8), (256, 16, 1), (64, 64, 8)]:
        paged_case(rng, head_dim, page_size, t)
    # e4m3 keys and values widened in the decode kernels: contiguous with key lengths (a
    # partial last tile) at both warp-step configurations, and paged with pages shorter than
    # the 128-key tiles.
    for head_dim, t in [(128, 1), (256, 16), (64, 8)]:
        fp8_case(rng, head_dim, t)
    paged_case(rng, 128, 16, 1, fp8=True)
    # FP8 attention on the Hopper forward's e4m3 kernel (elsewhere dequantised): V^T's boxes past
    # S (S' = 672: a partial last tile of 128 and of 64 keys), key lengths, causal at the bottom
    # right, GQA, head dims 128 and 96, and 256 and 192 (64-key tiles, V^T in the 64-byte
    # swizzle).
    for head_dim in (128, 96, 256, 192):
        fp8_attention_case(rng, head_dim)


def fp8_attention_case(rng, head_dim):
    q8, dq = jax_flashattn.quantize_fp8(rng.standard_normal((2, 300, 2, 4 * head_dim)))
    q8 = q8.reshape(2, 300, 8, head_dim)  # a kv head's 4 query heads share its descale
    (k8, dk), (v8, dv) = (jax_flashattn.quantize_fp8(rng.standard_normal((2, 650, 2, head_dim)))
                          for _ in range(2))
    out = jax_flashattn.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,
                                  is_causal=True, diagonal_alignment="bottom_right",
                                  key_value_seq_lengths=jnp.array([650, 333], jnp.int32))
    assert np.isfinite(np.asarray(out, np.float32)).all(), head_dim
    print(f"ok: FP8 attention H={head_dim}")


def fp8_case(rng, head_dim, t):
    q = jnp.asarray(rng.standard_normal((2, t, 8, head_dim)), jnp.bfloat16)
    k8, kd = jax_flashattn.quantize_fp8(rng.standard_normal((2, 900, 2, head_dim)))
    v8, vd = jax_flashattn.quantize_fp8(rng.standard_normal((2, 900, 2, head_dim)))
    out = jax_flashattn.attention(q, k8, v8, descale_k=kd, descale_v=vd,
                                  key_value_seq_lengths=jnp.array([900, 333], jnp.int32))
    assert np.isfinite(np.asarray(out, np.float32)).all(), (head_dim, t)
    print(f"ok: e4m3 keys and values H={head_dim} T={t}")


def paged_case(rng, head_dim, page_size, t, fp8=False):
    lengths = np.array([1500, 333], np.int32)
    max_pages = 1600 // page_size + 1
    pages = 2 * max_pages
    table = rng.permutation(pages)[:2 * max_pages].reshape(2, max_pages).astype(np.int32)
    table[1, (333 + page_size - 1) // page_size:] = 10**6  # past sequence 1's pages
    table[0, 3] = pages + 5  # inside sequence 0's 1500 tokens
    caches = [jnp.asarray(rng.standard_normal((pages, page_size, 2, head_dim)),
                          jnp.float8_e4m3fn if fp8 else jnp.bfloat16) for _ in range(2)]
    q = jnp.asarray(rng.standard_normal((2, t, 8, head_dim)), jnp.bfloat16)
    out = np.asarray(jax.jit(lambda *xs: jax_flashattn.paged_attention(
        *xs, implementation="cuda"))(q, *caches, table, lengths), np.float32)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all(), (head_dim, page_size, t)
    print(f"ok: paged H={head_dim} page {page_size} T={t}{' e4m3' if fp8 else ''}")


@contextlib.contextmanager
def switch(name):
    """The kernel switch `name` on for the calls traced inside (read when a call is traced)."""
    os.environ[name] = "1"
    try:
        yield
    finally:
        del os.environ[name]


def forward_case(rng, name, sizes, kernel=None, **kwargs):
    """One bf16 forward call on fresh inputs of `sizes` (B, T, S, N, K, H, as random_qkv takes
    them); fails unless the dispatcher picks `kernel` (when given; one of a tuple) and the output
    is finite."""
    q, k, v = random_qkv(rng, *sizes, jnp.bfloat16)
    if kernel is not None:
        allowed = kernel if isinstance(kernel, tuple) else (kernel,)
        assert jax_flashattn.forward_kernel(
            q, k, kwargs.get("bias"), kwargs.get("mask"),
            logits_soft_cap=kwargs.get("logits_soft_cap"),
            alibi_slopes=kwargs.get("alibi_slopes")) in allowed, name
    out = jax.jit(lambda q, k, v: jax_flashattn.attention(
        q, k, v, implementation="cuda", **kwargs))(q, k, v)
    assert np.isfinite(np.asarray(out, np.float32)).all(), name
    print(f"ok: {name}")


if __name__ == "__main__":
    main()
