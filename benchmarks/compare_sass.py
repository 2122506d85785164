"""Compare the machine code (SASS) of the CUDA kernels between a git revision and the working
tree: the guard of a refactor that is meant to leave every kernel as it was.

    python benchmarks/compare_sass.py BEFORE_REV [--arch sm_90a] [--dtype bf16,fp16]
                                      [--family forward_wgmma,...] [--jobs 2]

Each kernel family's instantiation template (ffi/cuda/instantiations/*.cu.in) is compiled for
every head dim its traits header lists (the list CMake instantiates), with nvcc -cubin, once
from a `git worktree` of BEFORE_REV and once from the working tree; the CUDA-core kernels too.
Each pair of cubins is disassembled with nvdisasm and compared as text, with the hash of
anonymous namespaces (which follows the file's contents, not the code) removed. Text-identical
SASS cannot change speed, so such a refactor needs no timing. Nor can a file whose
instructions are all the same, operands included, while the names of the functions they lie
in differ (a kernel parameter whose type was renamed): reported as "same instructions". A file
that differs otherwise is reported with how many instruction lines changed (opcodes only,
registers and addresses ignored), and needs the performance guard (compare_results.py); its
kernels' registers and spill bytes (ptxas) are listed before and after, the numbers that guard
records. Exit status 1 when any file differs.

Needs nvcc, and nvdisasm on PATH or given by --nvdisasm (it ships with the CUDA toolkit and
as the `nvidia-cuda-nvdisasm` wheel: `pip download nvidia-cuda-nvdisasm`, then unzip it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELEMS = {"bf16": "__nv_bfloat16", "fp16": "__half"}
# (family template, traits header, head-dim array): the list cmake/kernels/CMakeLists.txt reads.
FAMILIES = {
    "forward_mma_sync": ("ffi/cuda/mma_sync/traits.h", "kHeadDims"),
    "forward_mma_sync_segments": ("ffi/cuda/mma_sync/traits.h", "kHeadDims"),
    "forward_mma_sync_softcap": ("ffi/cuda/mma_sync/traits.h", "kHeadDims"),
    "forward_wgmma": ("ffi/cuda/wgmma/traits.h", "kHeadDims"),
    "forward_wgmma_segments": ("ffi/cuda/wgmma/traits.h", "kPaddedHeadDims"),
    "forward_wgmma_softcap": ("ffi/cuda/wgmma/traits.h", "kPaddedHeadDims"),
    "forward_wgmma_bias": ("ffi/cuda/wgmma/traits.h", "kPaddedHeadDims"),
    "forward_wgmma_alibi": ("ffi/cuda/wgmma/traits.h", "kPaddedHeadDims"),
    "forward_wgmma_e4m3": ("ffi/cuda/wgmma/traits.h", "kE4m3HeadDims"),
    "decode_mma_sync": ("ffi/cuda/decode/mma_sync_traits.h", "kDecodeHeadDims"),
    "decode_wgmma": ("ffi/cuda/decode/wgmma_traits.h", "kDecodeHeadDims"),
    "decode_mma_sync_softcap": ("ffi/cuda/decode/mma_sync_traits.h", "kDecodeHeadDims"),
    "decode_wgmma_softcap": ("ffi/cuda/decode/wgmma_traits.h", "kDecodeHeadDims"),
    "decode_mma_sync_bias": ("ffi/cuda/decode/mma_sync_traits.h", "kDecodeHeadDims"),
    "decode_mma_sync_fp8": ("ffi/cuda/decode/mma_sync_traits.h", "kDecodeHeadDims"),
    "decode_wgmma_fp8": ("ffi/cuda/decode/wgmma_traits.h", "kDecodeHeadDims"),
    "decode_wgmma_bias": ("ffi/cuda/decode/wgmma_traits.h", "kDecodeHeadDims"),
    "backward_mma_sync": ("ffi/cuda/mma_sync/backward_traits.h", "kBackwardHeadDims"),
    "backward_mma_sync_segments": ("ffi/cuda/mma_sync/backward_traits.h", "kBackwardHeadDims"),
    "backward_mma_sync_softcap": ("ffi/cuda/mma_sync/backward_traits.h", "kBackwardHeadDims"),
    "backward_wgmma": ("ffi/cuda/wgmma/backward_traits.h", "kBackwardHeadDims"),
    "backward_wgmma_segments": ("ffi/cuda/wgmma/backward_traits.h", "kBackwardPaddedHeadDims"),
    "backward_wgmma_deterministic": ("ffi/cuda/wgmma/backward_traits.h", "kBackwardPaddedHeadDims"),
    "backward_wgmma_softcap": ("ffi/cuda/wgmma/backward_traits.h", "kBackwardPaddedHeadDims"),
    "backward_wgmma_bias": ("ffi/cuda/wgmma/backward_traits.h", "kBackwardPaddedHeadDims"),
}
SIMT = ("ffi/cuda/simt/forward_simt.cu", "ffi/cuda/simt/backward_simt.cu")

_ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}")
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_ADDRESS_COMMENT = re.compile(r"/\*[0-9a-f]+\*/")


def head_dims(header_text: str, array: str) -> list[int]:
    """The head dims of `inline constexpr int <array>[] = {...};` in a traits header."""
    match = re.search(r"^inline constexpr int " + re.escape(array) + r"\[\] = \{([0-9, ]+)\}",
                      header_text, re.MULTILINE)
    if match is None:
        raise ValueError(f"no 'inline constexpr int {array}[] = {{...}};' list")
    return [int(x) for x in match.group(1).split(",")]


def normalized(sass: str) -> str:
    """nvdisasm text without what follows the file rather than the code: anonymous namespace
    hashes."""
    return _ANONYMOUS.sub("ANON", sass)


def _code_lines(sass: str):
    """(function, words) per instruction, function the name of the one it lies in, and
    (function, None) where a function starts; addresses dropped."""
    function = None
    for line in _ADDRESS_COMMENT.sub("", normalized(sass)).splitlines():
        text = line.strip()
        if text.startswith(".text.") and text.endswith(":"):
            function = text[len(".text."):-1]
            yield function, None
        elif text and (text[0].isupper() or text[0] == "@"):
            yield function, text.split()


def opcodes(sass: str) -> list[str]:
    """One line per instruction: its opcode (with its guard predicate dropped), or the function
    it starts; registers, operands and addresses are left out."""
    out = []
    for function, words in _code_lines(sass):
        if words is None:
            out.append(f".text.{function}:")
            continue
        if words[0].startswith("@"):
            words = words[1:]
        if words:
            out.append(words[0].rstrip(";"))
    return out


def instructions(sass: str) -> list[str]:
    """Every instruction with its operands and guard, spacing and addresses dropped: the code
    without the names of the functions it lies in (an instruction that names its own function,
    as a return does, names it "FUNCTION"; other functions' names stay)."""
    out = []
    for function, words in _code_lines(sass):
        if words is not None:
            text = " ".join(words)
            out.append(text.replace(function, "FUNCTION") if function else text)
    return out


def resources(ptxas_log: str) -> dict[str, tuple[int, int, int]]:
    """kernel -> (registers, spill store bytes, spill load bytes) from `ptxas -v` output, the
    kernel names with anonymous namespace hashes removed (as normalized() does)."""
    out, kernel, spills = {}, None, (0, 0)
    for line in ptxas_log.splitlines():
        if match := _ENTRY.search(line):
            kernel, spills = normalized(match.group(1)), (0, 0)
        elif kernel and (match := _SPILLS.search(line)):
            spills = (int(match.group(1)), int(match.group(2)))
        elif kernel and (match := _REGISTERS.search(line)):
            out[kernel] = (int(match.group(1)), *spills)
            kernel = None
    return out


def display_name(kernel: str) -> str:
    """A kernel's name as c++filt gives it, without the parameter list (the template arguments
    tell the instantiations apart), or as given where c++filt is missing or fails."""
    demangler = shutil.which("c++filt")
    if demangler is None:
        return kernel
    done = subprocess.run([demangler, kernel], capture_output=True, text=True)
    name = done.stdout.strip()
    return name.split("(")[0] if done.returncode == 0 and name else kernel


def resource_lines(before: dict, after: dict, name=lambda kernel: kernel) -> list[str]:
    """One line per kernel of either, by name(kernel): registers and spill bytes
    (stores/loads) before -> after."""
    def text(r):
        return "absent" if r is None else f"{r[0]} registers, {r[1]}/{r[2]} B spilled"
    return [f"    {name(kernel)}: {text(before.get(kernel))} -> {text(after.get(kernel))}"
            for kernel in sorted(set(before) | set(after))]


def changed_opcodes(before: str, after: str) -> int:
    """How many instruction lines differ between two disassemblies (added plus removed)."""
    diff = difflib.unified_diff(opcodes(before), opcodes(after), lineterm="", n=0)
    return sum(1 for line in diff
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def sources(tree: str, families: list[str], dtypes: list[str], out_dir: str) -> list[str]:
    """The .cu files to compile from `tree`: one per (family, dtype, head dim), and the
    CUDA-core kernels; generated ones are written to out_dir."""
    files = []
    for family in families:
        header, array = FAMILIES[family]
        with open(os.path.join(tree, header)) as f:
            dims = head_dims(f.read(), array)
        with open(os.path.join(tree, "ffi/cuda/instantiations", family + ".cu.in")) as f:
            template = f.read()
        for dtype in dtypes:
            for dim in dims:
                path = os.path.join(out_dir, f"{family}_{dtype}_hd{dim}.cu")
                with open(path, "w") as f:
                    f.write(template.replace("@ELEM@", ELEMS[dtype])
                            .replace("@HEAD_DIM@", str(dim)))
                files.append(path)
    files += [os.path.join(tree, path) for path in SIMT]
    return files


def compile_cubin(nvcc: str, tree: str, source: str, cubin: str, arch: str) -> tuple[bool, str]:
    """(whether the cubin was written, the compiler's output: ptxas -v's resource lines, or
    the end of the errors)."""
    command = [nvcc, "-I" + tree, "-O3", "-DNDEBUG", "-std=c++17", "--expt-relaxed-constexpr",
               f"-gencode=arch=compute_{arch[3:]},code={arch}", "-Xptxas", "-v", "-cubin",
               "-o", cubin, source]
    done = subprocess.run(command, capture_output=True, text=True)
    return (True, done.stderr) if done.returncode == 0 else (False, done.stderr[-2000:])


def build(nvcc: str, tree: str, files: list[str], out_dir: str, arch: str,
          jobs: int) -> tuple[dict, dict]:
    """(name -> cubin path, name -> its kernels' resources()) for every source of `tree`;
    raises on a compile error."""
    source_of = {os.path.splitext(os.path.basename(f))[0]: f for f in files}
    targets = {name: os.path.join(out_dir, name + ".cubin") for name in source_of}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(source_of, pool.map(
            lambda name: compile_cubin(nvcc, tree, source_of[name], targets[name], arch),
            source_of)))
    failed = {name: output for name, (ok, output) in done.items() if not ok}
    if failed:
        name, error = next(iter(failed.items()))
        raise RuntimeError(f"{tree}: {name} did not compile:\n{error}")
    return targets, {name: resources(output) for name, (_, output) in done.items()}


def disassemble(nvdisasm: str, cubin: str) -> str:
    return subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True,
                          check=True).stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="git revision to compare the working tree against")
    parser.add_argument("--arch", default="sm_90a", help="cubin architecture (sm_80, sm_90a)")
    parser.add_argument("--dtype", default="bf16", help="comma list of bf16, fp16")
    parser.add_argument("--family", default=",".join(FAMILIES),
                        help="comma list of kernel families (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = parser.parse_args(argv)
    families, dtypes = args.family.split(","), args.dtype.split(",")
    for name, given, known in (("family", families, FAMILIES), ("dtype", dtypes, ELEMS)):
        if unknown := [x for x in given if x not in known]:
            parser.error(f"unknown --{name} {unknown}; choose from {sorted(known)}")

    with tempfile.TemporaryDirectory() as scratch:
        before_tree = os.path.join(scratch, "before")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", before_tree,
                        args.before], check=True, capture_output=True)
        try:
            cubins, usage = {}, {}
            for label, tree in (("before", before_tree), ("after", REPO)):
                out_dir = os.path.join(scratch, label + "_out")
                os.makedirs(out_dir)
                files = sources(tree, families, dtypes, out_dir)
                cubins[label], usage[label] = build(args.nvcc, tree, files, out_dir, args.arch,
                                                    args.jobs)
            differing = 0
            for name in sorted(cubins["after"]):
                if name not in cubins["before"]:
                    print(f"{name}: new (no counterpart in {args.before})")
                    continue
                before = normalized(disassemble(args.nvdisasm, cubins["before"][name]))
                after = normalized(disassemble(args.nvdisasm, cubins["after"][name]))
                if before == after:
                    print(f"{name}: identical")
                elif instructions(before) == instructions(after):
                    print(f"{name}: same instructions (only function names differ)")
                else:
                    differing += 1
                    print(f"{name}: DIFFERS ({changed_opcodes(before, after)} instruction "
                          f"lines changed)")
                    print("\n".join(resource_lines(usage["before"][name],
                                                   usage["after"][name], display_name)))
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", before_tree],
                           capture_output=True)
    print(f"{differing} file(s) differ" if differing else "every file is identical")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
