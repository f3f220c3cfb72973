"""The docs' links and the benchmark files they cite exist.

Every relative link in docs/*.md and README.md resolves, and every `docs/benchmarks/...` path that
the docs, the README or the code mention names a file (or folder) that is there: a figure quoted
in the docs keeps its backing file. Braces expand (`decode-cuda-h200-{short,64k}.json`) and a `*`
must match at least one file; templates with `<...>` are not paths. In code, the path a command
writes (`--out PATH`, an `--out` option's default) is an output, not a citation.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
CODE_SUFFIXES = {".py", ".sh", ".toml", ".yaml", ".yml"}
SKIP_DIRS = {".venv", "build", "docs", ".git", "node_modules"}

BENCH_PATH = re.compile(r"docs/benchmarks/[A-Za-z0-9_./{},*<>|-]*")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for alt in match.group(1).split(",") for p in expand_braces(head + alt + tail)]


def exists(path: str) -> bool:
    path = path.rstrip("/")
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def code_files() -> list[Path]:
    files = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in SKIP_DIRS or path.suffix not in CODE_SUFFIXES or not path.is_file():
            continue
        if rel.parts[0] == "tests" and path.name == Path(__file__).name:
            continue
        files.append(path)
    return files


def benchmark_mentions(path: Path, code: bool) -> list[str]:
    found = []
    for line in path.read_text(errors="replace").splitlines():
        for match in BENCH_PATH.finditer(line):
            mention = match.group(0).rstrip(".,:;")
            if "<" in mention or mention.endswith("-"):  # a template, or a prefix in prose
                continue
            if code and ("--out" in line[: match.start()] or "default=" in line[: match.start()]):
                continue
            found += expand_braces(mention)
    return found


def test_brace_expansion() -> None:
    assert expand_braces("a-{x,y}-{1,2}.json") == ["a-x-1.json", "a-x-2.json", "a-y-1.json", "a-y-2.json"]
    assert expand_braces("plain.json") == ["plain.json"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    missing = []
    for target in MD_LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        target = target.split("#", 1)[0]
        for expanded in expand_braces(target):
            if not (doc.parent / expanded).exists():
                missing.append(expanded)
    assert not missing, f"{doc.relative_to(REPO)}: broken links {missing}"


def test_cited_benchmark_files_exist() -> None:
    missing = {}
    for path in DOCS:
        for mention in benchmark_mentions(path, code=False):
            if not exists(mention):
                missing.setdefault(mention, []).append(str(path.relative_to(REPO)))
    for path in code_files():
        for mention in benchmark_mentions(path, code=True):
            if not exists(mention):
                missing.setdefault(mention, []).append(str(path.relative_to(REPO)))
    assert not missing, f"cited benchmark files that do not exist: {missing}"


def test_the_check_finds_a_missing_file(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("see docs/benchmarks/no-such-run.json and docs/benchmarks/cache-{cpu,gpu}.json\n")
    mentions = benchmark_mentions(doc, code=False)
    assert mentions == ["docs/benchmarks/no-such-run.json", "docs/benchmarks/cache-cpu.json",
                        "docs/benchmarks/cache-gpu.json"]
    assert [m for m in mentions if not exists(m)] == ["docs/benchmarks/no-such-run.json"]
