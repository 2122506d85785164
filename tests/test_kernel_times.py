"""benchmarks/kernel_times.py: its reading of ncu's CSV, and its child call (CPU only)."""

import pytest

from helpers import load_benchmark_script

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def _line(i, name, unit, value, metric="gpu__time_duration.sum"):
    return (f'"{i}","7","python3","host","{name}","1","13","(256, 1, 1)","(64, 1, 1)","0",'
            f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"')


def test_kernels_after_the_last_marker_in_microseconds():
    times = load_benchmark_script("kernel_times")
    lines = ["==PROF== Connected to process 7", HEADER,
             _line(0, "warm_up_fusion", "ns", "5,000"),
             _line(1, "wrapped_sine", "ns", "900"),
             _line(2, "void forward_kernel<bf16, 128>(AttentionParams)", "ns", "1,234,567"),
             _line(2, "void forward_kernel<bf16, 128>(AttentionParams)", "dram__bytes", "9",
                   metric="dram__bytes_read.sum"),
             _line(3, "wrapped_sine", "us", "1.5"),
             _line(4, "void backward_kernel<bf16, 128>(AttentionParams)", "msecond", "1.25"),
             _line(5, "convert", "usecond", "45.5"),
             "==PROF== Disconnected from process 7"]
    assert times.kernels_after_marker(lines) == [
        ("void backward_kernel<bf16, 128>(AttentionParams)", 1250.0), ("convert", 45.5)]


def test_no_marker_or_an_unknown_unit_is_an_error():
    times = load_benchmark_script("kernel_times")
    with pytest.raises(ValueError, match="no marker"):
        times.kernels_after_marker([HEADER, _line(0, "forward", "ns", "10")])
    with pytest.raises(ValueError, match="unknown duration unit 'cycle'"):
        times.kernels_after_marker([HEADER, _line(0, "wrapped_sine", "cycle", "10")])


def _args(impl, mode, documents=None):
    return type("Args", (), dict(impl=impl, head_dim=32, seqlen=64, causal=True, dtype="bf16",
                                 mode=mode, tokens=128, hidden=64, documents=documents))()


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_child_runs_each_implementation(mode):
    """The child process's call, at a small size, on whatever device jax has."""
    times = load_benchmark_script("kernel_times")
    for impl in ("ours", "xla"):
        times.child(_args(impl, mode))


@pytest.mark.parametrize("documents", [0, 16])
def test_child_gives_our_calls_segment_ids(documents, monkeypatch):
    """--documents: our call takes segment ids, one document per row or packed ones."""
    times = load_benchmark_script("kernel_times")
    import jax_flashattn
    seen = []
    attention = jax_flashattn.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["query_segment_ids"])
        return attention(*args, **kwargs)

    monkeypatch.setattr(jax_flashattn, "attention", spy)
    times.child(_args("ours", "fwd", documents))
    ids = seen[0]
    assert ids.shape == (2, 64)
    assert (int(ids.max()) == 0) == (documents == 0)
