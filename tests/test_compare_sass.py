"""benchmarks/compare_sass.py, the SASS-identity guard of kernel refactors: its parsing and
comparison (CPU only; compiling needs nvcc and nvdisasm)."""

import pathlib
import re

import pytest

from helpers import load_benchmark_script

REPO = pathlib.Path(__file__).resolve().parents[1]

KERNEL = "_ZN13jax_flashattn4cuda49_GLOBAL__N__5545d00e_16_backward_simt_cu_ce2388bf18kernelEv"
SASS = f"""
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
.text.{KERNEL}:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, UR4, PT ;
        /*0020*/               @P0 EXIT ;
.L_x_0:
        /*0030*/                   IMAD.MOV.U32 R2, RZ, RZ, 0x4 ;
        /*0040*/                   EXIT ;
        /*0050*/                   RET.REL.NODEC R2 `({KERNEL}) ;
"""


def _load():
    return load_benchmark_script("compare_sass")


def test_head_dims_match_the_lists_cmake_instantiates():
    """Every family's list parses from its traits header, as cmake/kernels/CMakeLists.txt
    reads it; a header without the list is an error, not an empty list."""
    sass = _load()
    for family, (header, array) in sass.FAMILIES.items():
        dims = sass.head_dims((REPO / header).read_text(), array)
        assert dims and dims == sorted(dims), family
        assert (REPO / "ffi/cuda/instantiations" / f"{family}.cu.in").is_file(), family
    # Every family CMake instantiates, with the header and list it reads there.
    cmake = (REPO / "cmake/kernels/CMakeLists.txt").read_text()
    instantiated = re.findall(r"instantiate_head_dims\((\w+)\s+(\S+)\s+(\w+)\)", cmake)
    assert instantiated and {f: (h, a) for f, h, a in instantiated} == sass.FAMILIES
    templates = {path.name[:-len(".cu.in")]
                 for path in (REPO / "ffi/cuda/instantiations").glob("*.cu.in")}
    assert templates == set(sass.FAMILIES)
    assert sass.head_dims("inline constexpr int kHeadDims[] = {64, 128};", "kHeadDims") == [64, 128]
    with pytest.raises(ValueError, match="kHeadDims"):
        sass.head_dims("constexpr int other[] = {1};", "kHeadDims")


def test_anonymous_namespace_hashes_are_not_a_difference():
    """The same code compiled from a file whose contents changed elsewhere gets another
    anonymous-namespace hash: identical after normalisation, and no changed instructions."""
    sass = _load()
    moved = SASS.replace("5545d00e", "ee801fdb")
    assert moved != SASS
    assert sass.normalized(moved) == sass.normalized(SASS)
    assert sass.changed_opcodes(SASS, moved) == 0


def test_opcodes_drop_operands_predicates_and_addresses():
    sass = _load()
    ops = sass.opcodes(SASS)
    assert ops[1:] == ["LDC", "ISETP.GE.AND", "EXIT", "IMAD.MOV.U32", "EXIT", "RET.REL.NODEC"]
    assert ops[0].startswith(".text.") and "ANON" in ops[0]
    renamed = SASS.replace("R2, RZ", "R7, RZ").replace("/*0030*/", "/*0040*/")
    assert sass.changed_opcodes(SASS, renamed) == 0


def test_a_changed_instruction_is_counted():
    """One instruction replaced by two others: three changed lines."""
    sass = _load()
    changed = SASS.replace("IMAD.MOV.U32 R2, RZ, RZ, 0x4 ;", "MOV R2, 0x4 ;\n        NOP ;")
    assert sass.changed_opcodes(SASS, changed) == 3


def test_renamed_kernels_with_the_same_instructions_are_told_apart():
    """A kernel whose mangled name changed (a parameter type renamed) with the same code, its
    return naming it: the same instructions; a changed operand is not."""
    sass = _load()
    renamed = SASS.replace("18kernelEv", "18kernelENS_4MapsE")
    assert sass.normalized(renamed) != sass.normalized(SASS)
    assert sass.instructions(renamed) == sass.instructions(SASS)
    assert sass.instructions(SASS)[-3:] == ["IMAD.MOV.U32 R2, RZ, RZ, 0x4 ;", "EXIT ;",
                                           "RET.REL.NODEC R2 `(FUNCTION) ;"]
    other_register = SASS.replace("R2, RZ", "R7, RZ")
    assert sass.instructions(other_register) != sass.instructions(SASS)


PTXAS_LOG = f"""ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{KERNEL}' for 'sm_90a'
ptxas info    : Function properties for {KERNEL}
    24 bytes stack frame, 48 bytes spill stores, 100 bytes spill loads
ptxas info    : Used 128 registers, used 16 barriers, 24 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z5otherv' for 'sm_90a'
ptxas info    : Function properties for _Z5otherv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""


def test_resources_per_kernel_from_ptxas():
    """Registers and spill bytes per entry function, names normalised as the SASS is (the
    anonymous-namespace hash of another compile of the same kernel matches)."""
    sass = _load()
    usage = sass.resources(PTXAS_LOG)
    assert usage == {sass.normalized(KERNEL): (128, 48, 100), "_Z5otherv": (168, 0, 0)}
    assert sass.resources(PTXAS_LOG.replace("5545d00e", "ee801fdb")) == usage
    lines = sass.resource_lines(usage, {"_Z5otherv": (168, 8, 8)})
    assert lines == [  # sorted by name
        "    _Z5otherv: 168 registers, 0/0 B spilled -> 168 registers, 8/8 B spilled",
        f"    {sass.normalized(KERNEL)}: 128 registers, 48/100 B spilled -> absent"]
