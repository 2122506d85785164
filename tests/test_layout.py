"""The sources keep the layout docs/design.md describes: every project include names a file
that exists, the includes form no cycle, no kernel family's folder includes another family's
headers (what families share lives in ffi/cuda/common/ or at the dispatch level), and the
Python modules import each other without a cycle."""

import ast
import importlib.util
import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = (".h", ".cc", ".cu", ".cuh", ".in")
INCLUDE = re.compile(r'^\s*#\s*include\s+"(ffi/[^"]+)"', re.MULTILINE)
FAMILIES = ("mma_sync", "wgmma", "decode", "simt")


def project_includes() -> dict[str, list[str]]:
    """ffi-relative path of each source -> the project headers it includes."""
    root = REPO / "ffi"
    if not root.is_dir():
        pytest.skip("needs the source tree")
    return {f.relative_to(REPO).as_posix(): INCLUDE.findall(f.read_text())
            for f in sorted(root.rglob("*")) if f.suffix in SOURCES and f.is_file()}


def family(path: str) -> str | None:
    parts = path.split("/")
    return parts[2] if len(parts) > 3 and parts[:2] == ["ffi", "cuda"] and \
        parts[2] in FAMILIES else None


def test_includes_exist():
    missing = [(f, i) for f, incs in project_includes().items() for i in incs
               if not (REPO / i).is_file()]
    assert not missing, missing


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if state.get(nxt) is None and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_no_include_cycles():
    cycle = find_cycle(project_includes())
    assert cycle is None, " -> ".join(cycle)


def package_imports() -> dict[str, list[str]]:
    """Dotted module name (under jax_flashattn) -> the package modules it imports, at the top
    or inside functions, absolute or relative."""
    package = REPO / "src" / "jax_flashattn"
    if not package.is_dir():
        pytest.skip("needs the source tree")
    files = {}
    for f in sorted(package.rglob("*.py")):
        parts = f.relative_to(package).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"] = f

    def resolve(name: str) -> str | None:
        name = name.removeprefix("jax_flashattn").lstrip(".")
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, f in files.items():
        package_of = (module if f.name == "__init__.py" else module.rpartition(".")[0]).removeprefix(
            "__init__")
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("jax_flashattn.")]
            elif isinstance(node, ast.ImportFrom):
                origin = importlib.util.resolve_name(
                    "." * node.level + (node.module or ""), f"jax_flashattn.{package_of}"
                    if package_of else "jax_flashattn") if node.level else node.module or ""
                if not origin.startswith("jax_flashattn"):
                    continue
                names = [f"{origin}.{a.name}" for a in node.names] + [origin]
            else:
                continue
            found |= {m for m in map(resolve, names) if m and m != module}
        # A module's own package (its __init__) is not counted as a dependency of the module:
        # Python runs the __init__ first whatever the module imports.
        graph[module] = sorted(m for m in found if not module.startswith(m + ".") and
                               m != "__init__")
    return graph


def test_no_python_import_cycles():
    graph = package_imports()
    assert graph["_ops"] == ["_ffi", "segments"] and "_ops" not in graph["_ffi"], graph
    assert graph["segments"] == [], graph
    assert "_bench.configs" in graph["_bench.timing"] and "_bench" in graph["__main__"], graph
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_families_do_not_include_each_other():
    crossings = [(f, i) for f, incs in project_includes().items() for i in incs
                 if family(f) and family(i) and family(i) != family(f)]
    assert not crossings, crossings


def test_common_and_cpu_code_include_no_family():
    """ffi/cuda/common/ is what the families share, and the CPU side builds without CUDA."""
    leaks = [(f, i) for f, incs in project_includes().items() for i in incs
             if (f.startswith("ffi/cuda/common/") or not f.startswith("ffi/cuda/"))
             and family(i)]
    assert not leaks, leaks


def test_the_checks_see_a_crossing(monkeypatch):
    """The family rule fails on a crossing (guards the path parsing above)."""
    assert family("ffi/cuda/mma_sync/forward_kernel.cuh") == "mma_sync"
    assert family("ffi/cuda/common/ptx.cuh") is None
    assert family("ffi/decode_plan.h") is None
    fake = {"ffi/cuda/decode/block.cuh": ["ffi/cuda/mma_sync/traits.h"]}
    monkeypatch.setattr(sys.modules[__name__], "project_includes", lambda: fake)
    with pytest.raises(AssertionError):
        test_families_do_not_include_each_other()
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None
