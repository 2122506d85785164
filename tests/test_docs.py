"""The repository's text stands alone: no words about work periods or issue numbers, no file
outside the repository, and every path the docs and comments name exists."""

import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".cc", ".h", ".cu", ".cuh", ".in", ".cmake", ".toml", ".txt", ""}

# What only a diary says: work periods (the word is spelled in two pieces below, so that this
# file does not contain it), issue numbers ("#5"), files that are not in the repository.
FORBIDDEN = {
    "work periods": re.compile(r"\bses" r"sions?\b", re.IGNORECASE),
    "issue numbers": re.compile(r"(?<![\w&])#\d+\b"),
    "files outside the repository": re.compile(r"DESIGN\.md|\bdevtools/|\.\./shared"),
}
# Relative paths of the repository's own files, as the docs and comments name them.
PATH = re.compile(r"(?<![\w./-])((?:src|ffi|tests|benchmarks|docs|examples|cmake|\.ci)/"
                  r"[\w./-]*[\w])")


def tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    files = [REPO / n for n in names]
    return [f for f in files if f.suffix in TEXT_SUFFIXES and f.is_file()]


@pytest.fixture(scope="module")
def texts():
    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout")
    return {f.relative_to(REPO).as_posix(): f.read_text(errors="replace")
            for f in tracked_text_files()}


@pytest.mark.parametrize("kind", sorted(FORBIDDEN))
def test_no_diary_words(texts, kind):
    pattern = FORBIDDEN[kind]
    found = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for name, text in texts.items() if name != "tests/test_docs.py"
             for m in pattern.finditer(text)]
    assert not found, f"{kind} in tracked files:\n" + "\n".join(found)


def test_named_paths_exist(texts):
    missing = []
    for name, text in texts.items():
        for m in PATH.finditer(text):
            path = m.group(1).rstrip(".")
            if "{" in path or "*" in path or path.endswith("/"):
                continue
            if not (REPO / path).exists():
                missing.append(f"{name}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_markdown_links_resolve(texts):
    broken = []
    for name, text in texts.items():
        if not name.endswith(".md"):
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            if not ((REPO / name).parent / target).exists():
                broken.append(f"{name}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
