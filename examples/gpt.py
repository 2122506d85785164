"""A small GPT-style language model in Flax Linen, trained with optax, with a switch between
jax_flashattn's attention and Flax's default.

    python examples/gpt.py                                   # toy size: ~30 s on a CPU
    python examples/gpt.py --size small --attention flash,flax,cudnn --steps 15

`--attention` takes one name or a comma-separated list, run one after another in the same
process on the same data and initial weights:
  flash  jax_flashattn.flax.make_attention_fn(is_causal=True): our kernels, no mask array
  flax   flax.linen.dot_product_attention with a make_causal_mask mask (Linen's default)
  cudnn  jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)
  xla    jax.nn.dot_product_attention(implementation="xla", is_causal=True)
The output ends with one `summary` line per attention (median step time, tokens/s, compile
time, final loss); the first `--warmup` steps (compilation included) are left out of the timing.
Without jax_flashattn's CUDA kernels on a GPU, `flash` falls back to XLA (with a warning; the
header line says whether the kernels are built).

The data is synthetic and deterministic (see `SyntheticText`): every sequence repeats a short
motif drawn from a sparse Markov chain, so the loss first falls to the chain's entropy and then
towards zero once attention learns to copy the motif from context.

`--packed` trains on packed rows instead: documents of random lengths (each its own motif)
concatenated into every row, with segment ids so that a token attends within its document only,
positions that restart at each document, and the loss masked where a target starts the next
document. `flash`, `cudnn` and `xla` get the segment ids (`cudnn` and `xla` as the equivalent
mask, which jax.nn needs), `flax` a combined causal and document mask.

Needs jax, flax, optax and numpy; rich, when installed, draws a progress bar.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_flashattn.flax

ATTENTIONS = ("flash", "flax", "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    seq_len: int
    batch_size: int
    dtype: str  # compute dtype; parameters and optimizer state stay float32
    learning_rate: float
    warmup_steps: int  # of the learning-rate schedule (linear ramp, then constant)


SIZES = {
    # Runs on a laptop CPU in seconds.
    "toy": Config(vocab_size=128, num_layers=2, d_model=64, num_heads=4, seq_len=64,
                  batch_size=16, dtype="float32", learning_rate=3e-3, warmup_steps=10),
    # GPT-2 small's shape (112M parameters with a 32k vocabulary) at T = 2048, 16k tokens/step.
    "small": Config(vocab_size=32768, num_layers=12, d_model=768, num_heads=12, seq_len=2048,
                    batch_size=8, dtype="bfloat16", learning_rate=6e-4, warmup_steps=20),
    # The same depth, sequence and batch at width 1024 with head dim 128 (8 heads) or 256
    # (4 heads, as Gemma's): 187M parameters each, the same FLOPs outside attention.
    "h128": Config(vocab_size=32768, num_layers=12, d_model=1024, num_heads=8, seq_len=2048,
                   batch_size=8, dtype="bfloat16", learning_rate=6e-4, warmup_steps=20),
    "h256": Config(vocab_size=32768, num_layers=12, d_model=1024, num_heads=4, seq_len=2048,
                   batch_size=8, dtype="bfloat16", learning_rate=6e-4, warmup_steps=20),
}


class SyntheticText:
    """Deterministic batches of token sequences with structure at two scales.

    Tokens follow a sparse Markov chain (each token has `branching` equally likely successors);
    each sequence is a motif of `motif_len` tokens (a range; by default up to a quarter of the
    sequence, at most 48) walked on that chain and repeated to fill the sequence, with a
    fraction `noise` of tokens replaced at random. A model learns the chain first (loss
    log(vocab) -> about log(branching)), then to copy the motif through attention.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, *, branching: int = 4,
                 motif_len: tuple[int, int] | None = None, noise: float = 0.01):
        if motif_len is None:  # at least four repeats per sequence
            longest = max(2, min(48, seq_len // 4))
            motif_len = (max(2, longest // 4), longest)
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.branching, self.motif_len, self.noise = branching, motif_len, noise
        self.successors = np.random.default_rng(seed).integers(0, vocab_size,
                                                               (vocab_size, branching))
        self.rng = np.random.default_rng(seed + 1)

    def packed_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, segment ids, positions), each int32 [batch_size, seq_len + 1]: rows packed
        with documents of random lengths (an eighth to half the row), each one `batch`'s
        sequence cut short; positions count from 0 in each document."""
        total = self.seq_len + 1
        tokens = np.empty((batch_size, total), np.int32)
        ids = np.empty((batch_size, total), np.int32)
        positions = np.empty((batch_size, total), np.int32)
        lo, hi = max(1, total // 8), max(2, total // 2)
        for row in range(batch_size):
            start, doc = 0, 0
            while start < total:
                length = min(int(self.rng.integers(lo, hi + 1)), total - start)
                tokens[row, start:start + length] = self.batch(1)[0, :length]
                ids[row, start:start + length] = doc
                positions[row, start:start + length] = np.arange(length)
                start, doc = start + length, doc + 1
        return tokens, ids, positions

    def batch(self, batch_size: int) -> np.ndarray:
        """int32 [batch_size, seq_len + 1]: inputs are [:, :-1], targets [:, 1:]."""
        rng, (lo, hi) = self.rng, self.motif_len
        lengths = rng.integers(lo, hi + 1, batch_size)
        walk = np.empty((batch_size, hi), np.int64)
        walk[:, 0] = rng.integers(0, self.vocab_size, batch_size)
        for i in range(1, hi):
            walk[:, i] = self.successors[walk[:, i - 1], rng.integers(0, self.branching,
                                                                      batch_size)]
        positions = np.arange(self.seq_len + 1)[None, :] % lengths[:, None]
        tokens = np.take_along_axis(walk, positions, axis=1)
        noisy = rng.random(tokens.shape) < self.noise
        tokens[noisy] = rng.integers(0, self.vocab_size, int(noisy.sum()))
        return tokens.astype(np.int32)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""
    config: Config
    attention_fn: callable

    @nn.compact
    def __call__(self, x, mask, segment_ids=None):
        dtype = jnp.dtype(self.config.dtype)
        h = nn.LayerNorm(dtype=dtype)(x)
        fn = self.attention_fn
        if segment_ids is not None:  # packed rows: each token attends within its document
            fn = functools.partial(fn, query_segment_ids=segment_ids,
                                   key_value_segment_ids=segment_ids)
        h = nn.MultiHeadDotProductAttention(num_heads=self.config.num_heads, dtype=dtype,
                                            attention_fn=fn)(h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=dtype)(x)
        h = nn.Dense(4 * self.config.d_model, dtype=dtype)(h)
        h = nn.Dense(self.config.d_model, dtype=dtype)(nn.gelu(h))
        return x + h


class GPT(nn.Module):
    """Token + learned position embeddings, `num_layers` blocks, tied output embedding."""
    config: Config
    attention_fn: callable
    use_mask: bool  # pass a materialised causal mask (Flax's default attention needs one)

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None):
        """Packed rows pass segment ids and positions [B, T]; otherwise position t is t."""
        cfg, dtype = self.config, jnp.dtype(self.config.dtype)
        init = nn.initializers.normal(stddev=0.02)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=dtype)
        table = self.param("positions", init, (cfg.seq_len, cfg.d_model))
        if positions is None:
            x = embed(tokens) + table[:tokens.shape[-1]].astype(dtype)
        else:
            x = embed(tokens) + table[positions].astype(dtype)
        mask = None
        if self.use_mask:
            mask = nn.make_causal_mask(tokens)
            if segment_ids is not None:
                mask = nn.combine_masks(mask, nn.make_attention_mask(segment_ids, segment_ids,
                                                                     pairwise_fn=jnp.equal))
        for _ in range(cfg.num_layers):
            x = Block(cfg, self.attention_fn)(x, mask, None if self.use_mask else segment_ids)
        x = nn.LayerNorm(dtype=dtype)(x)
        return embed.attend(x).astype(jnp.float32)  # [B, T, vocab] logits


def attention_fn(kind: str):
    """(attention_fn for nn.MultiHeadDotProductAttention, whether it needs the causal mask)."""
    if kind == "flash":
        return jax_flashattn.flax.make_attention_fn(is_causal=True), False
    if kind == "flax":
        return nn.dot_product_attention, True
    if kind in ("cudnn", "xla"):
        # jax_flashattn.attention hands these implementations to jax.nn.dot_product_attention.
        return jax_flashattn.flax.make_attention_fn(is_causal=True, implementation=kind), False
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {kind!r}")


def make_optimizer(config: Config) -> optax.GradientTransformation:
    schedule = optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))


@dataclasses.dataclass
class RunResult:
    attention: str
    losses: list[float]
    step_times: list[float]  # seconds, one per step, the first ones include compilation
    warmup: int
    num_params: int
    packed: bool = False
    params: object = None  # the trained parameters (examples/generate.py generates from them)

    @property
    def timed(self) -> list[float]:
        return self.step_times[self.warmup:]

    def summary(self, config: Config) -> str:
        tokens = config.batch_size * config.seq_len
        step = statistics.median(self.timed) if self.timed else float("nan")
        return (f"summary attention={self.attention} device={jax.devices()[0].device_kind!r} "
                f"params={self.num_params / 1e6:.1f}M layers={config.num_layers} "
                f"d_model={config.d_model} heads={config.num_heads} batch={config.batch_size} "
                f"seq_len={config.seq_len} packed={self.packed} dtype={config.dtype} "
                f"timed_steps={len(self.timed)} "
                f"step_ms={step * 1e3:.1f} tokens_per_s={tokens / step:.0f} "
                f"compile_s={self.step_times[0] - step:.1f} final_loss={self.losses[-1]:.4f}")


def train(config: Config, attention: str, *, steps: int, warmup: int = 2, seed: int = 0,
          log_every: int = 0, progress: bool = False, packed: bool = False) -> RunResult:
    """Trains from a fixed initialisation on fixed data (both from `seed`), so runs with
    different attentions see the same numbers; returns per-step losses and times. `packed`:
    rows packed with documents (SyntheticText.packed_batch), the loss over the targets that
    continue their document."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    fn, use_mask = attention_fn(attention)
    model = GPT(config, fn, use_mask)
    data = SyntheticText(config.vocab_size, config.seq_len, seed)
    optimizer = make_optimizer(config)

    @jax.jit
    def init(key):
        params = model.init(key, jnp.zeros((config.batch_size, config.seq_len), jnp.int32))
        return params["params"], optimizer.init(params["params"])
    params, opt_state = init(jax.random.key(seed))
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch, segment_ids=None, positions=None):
        def loss_fn(params):
            if segment_ids is None:
                logits = model.apply({"params": params}, batch[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, batch[:, 1:]).mean()
            logits = model.apply({"params": params}, batch[:, :-1], segment_ids[:, :-1],
                                 positions[:, :-1])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
            continues = segment_ids[:, :-1] == segment_ids[:, 1:]
            return jnp.sum(jnp.where(continues, losses, 0.0)) / jnp.sum(continues)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    result = RunResult(attention, [], [], min(warmup, steps - 1), num_params, packed)
    tokens_per_step = config.batch_size * config.seq_len
    with _Progress(progress, f"{attention:>5}", steps) as bar:
        for step in range(steps):
            # Host-side, outside the timed region.
            batch = data.packed_batch(config.batch_size) if packed else (
                data.batch(config.batch_size),)
            start = time.perf_counter()
            params, opt_state, loss = train_step(params, opt_state, *batch)
            loss = float(loss)  # waits for the step to finish
            result.step_times.append(time.perf_counter() - start)
            result.losses.append(loss)
            rate = tokens_per_step / result.step_times[-1]
            bar.advance(loss, rate)
            if log_every and (step % log_every == 0 or step == steps - 1):
                bar.print(f"{attention} step {step:5d}  loss {loss:8.4f}  "
                          f"{result.step_times[-1] * 1e3:9.1f} ms  {rate:12,.0f} tokens/s")
    result.params = params
    return result


class _Progress:
    """A rich progress bar when rich is installed and `enabled`; otherwise only the log lines."""

    def __init__(self, enabled: bool, name: str, total: int):
        self.bar = None
        if enabled:
            try:
                import rich.progress
            except ImportError:
                return
            self.bar = rich.progress.Progress(
                rich.progress.TextColumn("{task.description}"), rich.progress.BarColumn(),
                rich.progress.MofNCompleteColumn(), rich.progress.TextColumn("{task.fields[info]}"),
                rich.progress.TimeElapsedColumn())
            self.task = self.bar.add_task(name, total=total, info="compiling")

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def advance(self, loss: float, tokens_per_s: float):
        if self.bar is not None:
            self.bar.update(self.task, advance=1,
                            info=f"loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s")

    def print(self, line: str):
        if self.bar is not None:
            self.bar.console.print(line, highlight=False)
        else:
            print(line, flush=True)


def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="toy",
                        help="preset model and batch size (default: toy)")
    parser.add_argument("--attention", default="flash",
                        help=f"one of {', '.join(ATTENTIONS)}, or a comma-separated list of "
                             "them run in turn (default: flash)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per attention (default: 300 toy, 15 small)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="leading steps left out of the timing (default: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=None,
                        help="print a loss line every N steps (default: steps // 10)")
    parser.add_argument("--no-progress", action="store_true", help="no rich progress bar")
    parser.add_argument("--packed", action="store_true",
                        help="rows packed with documents of random lengths, segment ids")
    for field in dataclasses.fields(Config):
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=str if field.name == "dtype" else type(
                                getattr(SIZES["toy"], field.name)),
                            default=None, help=f"override the preset's {field.name}")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                 if getattr(args, f.name) is not None}
    config = dataclasses.replace(SIZES[args.size], **overrides)
    args.attention = [a.strip() for a in args.attention.split(",") if a.strip()]
    for kind in args.attention:
        if kind not in ATTENTIONS:
            parser.error(f"--attention: {kind!r} is not one of {', '.join(ATTENTIONS)}")
    if args.steps is None:
        args.steps = 300 if args.size == "toy" else 15
    if args.log_every is None:
        args.log_every = max(1, args.steps // 10)
    return args, config


def main(argv=None) -> list[RunResult]:
    args, config = parse_args(argv)
    print(f"jax {jax.__version__}, flax {flax.__version__} on {jax.devices()[0].device_kind}; "
          f"jax_flashattn CUDA kernels built: {jax_flashattn.cuda_built()}", flush=True)
    print(config, flush=True)
    results = []
    for kind in args.attention:
        results.append(train(config, kind, steps=args.steps, warmup=args.warmup, seed=args.seed,
                             log_every=args.log_every,
                             progress=not args.no_progress and sys.stdout.isatty(),
                             packed=args.packed))
    for result in results:
        print(result.summary(config), flush=True)
    return results


if __name__ == "__main__":
    main()
