"""Greedy generation from the GPT example's model with a paged KV cache, checked token for token.

    python examples/generate.py                     # toy size: trains briefly on a CPU, generates
    python examples/generate.py --size small --steps 200 --new-tokens 256 --page-size 64

The model of examples/gpt.py is trained for `--steps` steps on its synthetic text, then
`--prompts` prompts of ragged lengths (the start of held-out sequences) are prefilled in chunks
of `--chunk` tokens and continued by `--new-tokens` greedy steps. Every layer's keys and values
live in pages of one pool per layer, [P, page_size, heads, head_dim], the sequences' pages
scattered over it through a page table: each step writes its tokens' keys and values into
their pages (jax_flashattn.paged_cache_update, in place: the caches are donated) and attends
each sequence's cache (jax_flashattn.paged_attention, causal at the bottom right of each
sequence). The same Flax module runs it, with an attention function that reads and writes the
pages instead of attending the step's own keys.

The check: the model run on each whole sequence (prompt and generated tokens) without a cache
must pick the generated token at every generated position; a different pick counts as a near
tie when its logit is within --tie-tolerance of the best one (rounding in bfloat16), and any
other difference makes the run exit with status 1. Prints prefill and decode tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpt  # noqa: E402  (examples/gpt.py: the model, its data and its training step)


class PagedLayers:
    """The attention function of one generation step: the Flax module calls it once per layer,
    in order, with the step's projected q, k, v [B, T, heads, head_dim]; it writes k, v at the
    step's positions into that layer's pages, attends the cache and keeps the updated pages."""

    def __init__(self, key_caches, value_caches, page_table, positions, kv_lens, q_lens):
        self.key_caches, self.value_caches = list(key_caches), list(value_caches)
        self.page_table, self.positions = page_table, positions
        self.kv_lens, self.q_lens = kv_lens, q_lens
        self.layer = 0

    def __call__(self, query, key, value, bias=None, mask=None, **unused):
        del bias, mask, unused  # causal through the page table; no dropout at inference
        i = self.layer
        self.key_caches[i], self.value_caches[i] = jax_flashattn.paged_cache_update(
            self.key_caches[i], self.value_caches[i], self.page_table, self.positions, key,
            value)
        self.layer += 1
        return jax_flashattn.paged_attention(query, self.key_caches[i], self.value_caches[i],
                                             self.page_table, self.kv_lens,
                                             query_seq_lengths=self.q_lens)


@dataclasses.dataclass
class GenerationResult:
    tokens: np.ndarray        # [prompts, longest prompt + new tokens], 0 past each sequence
    prompt_lens: np.ndarray   # [prompts]
    mismatches: int           # generated tokens the whole-sequence run did not pick (no tie)
    near_ties: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def train_params(config: gpt.Config, steps: int, seed: int):
    """The example's model trained for `steps` steps with our attention (gpt.train): its
    parameters, and the synthetic text it learned, for held-out prompts."""
    result = gpt.train(config, "flash", steps=steps, warmup=0, seed=seed)
    print(f"trained {steps} steps, loss {result.losses[-1]:.4f}", flush=True)
    data = gpt.SyntheticText(config.vocab_size, config.seq_len, seed)
    data.rng = np.random.default_rng([seed, 1])  # the same chain, sequences training never drew
    return result.params, data


def generate(config: gpt.Config, params, prompts: np.ndarray, prompt_lens: np.ndarray, *,
             new_tokens: int, page_size: int, chunk: int, seed: int,
             tie_tolerance: float) -> GenerationResult:
    batch = len(prompt_lens)
    capacity = int(prompt_lens.max()) + new_tokens
    if capacity > config.seq_len:
        raise ValueError(f"the longest prompt plus --new-tokens ({capacity}) must fit the "
                         f"model's {config.seq_len} positions")
    heads, head_dim = config.num_heads, config.d_model // config.num_heads
    dtype = jnp.dtype(config.dtype)
    # Each sequence's pages scattered over the pool (one spare page no one uses).
    max_pages = -(-capacity // page_size)
    pages = batch * max_pages + 1
    page_table = np.random.default_rng(seed).permutation(pages)[:batch * max_pages]
    page_table = jnp.asarray(page_table.reshape(batch, max_pages).astype(np.int32))
    shape = (pages, page_size, heads, head_dim)
    key_caches = [jnp.zeros(shape, dtype) for _ in range(config.num_layers)]
    value_caches = [jnp.zeros(shape, dtype) for _ in range(config.num_layers)]

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(params, key_caches, value_caches, tokens, positions, kv_lens, q_lens):
        """tokens, positions [B, T] (-1 where a sequence has no token): logits [B, T, vocab]
        and the caches with the step's keys and values written."""
        layers = PagedLayers(key_caches, value_caches, page_table, positions, kv_lens, q_lens)
        model = gpt.GPT(config, layers, False)
        logits = model.apply({"params": params}, tokens, None, jnp.maximum(positions, 0))
        return logits, layers.key_caches, layers.value_caches

    out = np.zeros((batch, capacity), np.int32)
    out[:, :prompts.shape[1]] = prompts
    lengths = np.zeros(batch, np.int32)  # tokens in each sequence's cache
    next_token = np.zeros(batch, np.int32)
    # Compiled first by a chunk that writes nothing (every position -1, no query, no key).
    nothing = np.full((batch, chunk), -1, np.int32)
    zeros = np.zeros(batch, np.int32)
    _, key_caches, value_caches = step(params, key_caches, value_caches, np.maximum(nothing, 0),
                                       nothing, zeros, zeros)
    # Prefill, `chunk` positions at a time; a sequence whose prompt ended writes nothing.
    start = time.perf_counter()
    for c0 in range(0, int(prompt_lens.max()), chunk):
        q_lens = np.clip(prompt_lens - c0, 0, chunk).astype(np.int32)
        positions = np.where(np.arange(chunk)[None, :] < q_lens[:, None],
                             c0 + np.arange(chunk)[None, :], -1).astype(np.int32)
        tokens = np.take_along_axis(out, np.maximum(positions, 0), axis=1)
        logits, key_caches, value_caches = step(params, key_caches, value_caches, tokens,
                                                positions, lengths + q_lens, q_lens)
        logits = np.asarray(logits)
        for b in np.nonzero(q_lens)[0]:
            next_token[b] = np.argmax(logits[b, q_lens[b] - 1])
        lengths += q_lens
    prefill_s = time.perf_counter() - start
    # Decode one token per sequence per step; the first step (compilation) is left out of the
    # rate.
    decode_s = 0.0
    for i in range(new_tokens):
        out[np.arange(batch), lengths] = next_token
        start = time.perf_counter()
        logits, key_caches, value_caches = step(params, key_caches, value_caches,
                                                next_token[:, None], lengths[:, None],
                                                lengths + 1, None)
        next_token = np.argmax(np.asarray(logits)[:, 0], axis=-1).astype(np.int32)
        if i:
            decode_s += time.perf_counter() - start
        lengths += 1
    # The last step's prediction is not part of the sequences.
    result = check(config, params, out, prompt_lens, lengths, tie_tolerance)
    return dataclasses.replace(
        result, prefill_tokens_per_s=float(prompt_lens.sum()) / prefill_s,
        decode_tokens_per_s=batch * (new_tokens - 1) / decode_s if new_tokens > 1 else 0.0)


def check(config, params, tokens, prompt_lens, lengths, tie_tolerance) -> GenerationResult:
    """The whole sequences through the model without a cache: at every generated position
    p, the greedy pick from positions < p must be tokens[p]."""
    fn, _ = gpt.attention_fn("flash")
    logits = np.asarray(jax.jit(lambda p, t: gpt.GPT(config, fn, False).apply({"params": p}, t))(
        params, jnp.asarray(tokens)), np.float64)
    mismatches = ties = 0
    for b in range(len(prompt_lens)):
        for p in range(int(prompt_lens[b]), int(lengths[b])):
            row = logits[b, p - 1]
            if np.argmax(row) == tokens[b, p]:
                continue
            if row.max() - row[tokens[b, p]] <= tie_tolerance:
                ties += 1
            else:
                mismatches += 1
                print(f"sequence {b}, position {p}: generated {tokens[b, p]}, the whole "
                      f"sequence picks {np.argmax(row)} (logits {row[tokens[b, p]]:.4f} and "
                      f"{row.max():.4f})")
    return GenerationResult(tokens, prompt_lens, mismatches, ties, 0.0, 0.0)


def main(argv=None) -> GenerationResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(gpt.SIZES), default="toy")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps before generating (default: 200 toy, 100 else)")
    parser.add_argument("--prompts", type=int, default=4, help="sequences generated together")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="the longest prompt (default: a quarter of the model's positions); "
                             "the others are ragged, down to half of it")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="greedy steps (default: the positions left after --prompt-len)")
    parser.add_argument("--page-size", type=int, default=16, choices=(16, 32, 64, 128, 256))
    parser.add_argument("--chunk", type=int, default=None,
                        help="prefill chunk (default: a third of --prompt-len, at least 1)")
    parser.add_argument("--tie-tolerance", type=float, default=None,
                        help="logit gap counted as a near tie (default: 1e-4 float32, 0.1 "
                             "bfloat16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = gpt.SIZES[args.size]
    steps = args.steps if args.steps is not None else (200 if args.size == "toy" else 100)
    if steps < 1:
        parser.error(f"--steps must be >= 1, got {steps}")
    prompt_len = args.prompt_len or max(2, config.seq_len // 4)
    new_tokens = args.new_tokens if args.new_tokens is not None else config.seq_len - prompt_len
    chunk = args.chunk or max(1, prompt_len // 3)
    tie = args.tie_tolerance if args.tie_tolerance is not None else (
        1e-4 if config.dtype == "float32" else 0.1)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; jax_flashattn CUDA "
          f"kernels built: {jax_flashattn.cuda_built()}", flush=True)
    params, data = train_params(config, steps, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompt_lens = rng.integers(max(1, prompt_len // 2), prompt_len + 1, args.prompts)
    prompts = data.batch(args.prompts)[:, :prompt_len]
    prompts = np.where(np.arange(prompt_len)[None, :] < prompt_lens[:, None], prompts, 0)
    result = generate(config, params, prompts.astype(np.int32), prompt_lens.astype(np.int32),
                      new_tokens=new_tokens, page_size=args.page_size, chunk=chunk,
                      seed=args.seed, tie_tolerance=tie)
    generated = args.prompts * new_tokens
    print(f"generated {generated} tokens ({args.prompts} sequences, prompts of "
          f"{prompt_lens.min()}-{prompt_lens.max()} tokens, pages of {args.page_size}, prefill "
          f"chunks of {chunk}): {result.mismatches} mismatches, {result.near_ties} near ties "
          f"against the whole sequences")
    print(f"summary device={jax.devices()[0].device_kind!r} size={args.size} "
          f"prefill_tokens_per_s={result.prefill_tokens_per_s:.0f} "
          f"decode_tokens_per_s={result.decode_tokens_per_s:.0f} "
          f"mismatches={result.mismatches} near_ties={result.near_ties}", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(1 if main().mismatches else 0)
