"""Structure figures of a cedserve tree (issue 30): what a maintainer pays for the layering.

    python benchmarks/structure.py [TREE] [--out FILE.json]

On TREE (default: this checkout) it reports
  (a) imports that run up the layer table (`tests/unit/test_layering.py` of THIS checkout: the table
      and the parser the test enforces, applied to TREE as it is, so an old tree is measured by the
      new rule),
  (b) lines in the five largest modules of the package (generated protobuf code left out),
  (c) duplicated blocks: runs of 6+ identical stripped non-blank lines found in 2+ places of the package
      (each place counted), also with import statements left out,
  (d) the router process: a fresh interpreter (with TREE first on sys.path) imports what `cedserve
      router` imports (`cedserve.cli`, then the router's server module) and reports the import time,
      its resident memory (`ru_maxrss`) and whether torch came in; then it loads the served model's
      config and tokenizer as the router does for a preset (`_served_model`), and reports torch again.
Prints a table and writes the JSON (date, command, machine, figures).
"""

from __future__ import annotations

import argparse
import ast
import collections
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parents[1]
MIN_RUN = 6


def layering() -> ModuleType:
    """`tests/unit/test_layering.py` of this checkout, loaded as a module."""
    path = HERE / "tests" / "unit" / "test_layering.py"
    spec = importlib.util.spec_from_file_location("cedserve_layering", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


def upward(tree: Path, rules: ModuleType) -> dict[str, Any]:
    imports = rules.all_imports(tree)
    ups = [imp for imp in imports if imp.runs_up]
    by_pair = collections.Counter(f"{rules.unit_of(i.importer)} -> {rules.unit_of(i.imported)}" for i in ups)
    return {"count": len(ups), "imports_total": len(imports), "by_units": dict(by_pair.most_common()),
            "imports": [str(i) for i in ups]}


def largest(modules: dict[str, Path], tree: Path, n: int = 5) -> list[dict[str, Any]]:
    sizes = sorted(((len(p.read_text().splitlines()), p) for p in modules.values()), reverse=True)
    return [{"file": str(p.relative_to(tree)), "lines": lines} for lines, p in sizes[:n]]


def import_lines(source: str) -> set[int]:
    """Line numbers (1-based) of every import statement in `source`."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def duplicated_blocks(modules: dict[str, Path], tree: Path, skip_imports: bool = False) -> dict[str, Any]:
    """Maximal runs of >= MIN_RUN stripped non-blank lines whose every MIN_RUN-line window also
    occurs somewhere else (another file, or elsewhere in the same file). `skip_imports`: import
    statements left out first (two modules importing the same names repeat no logic)."""
    files = {}
    for p in modules.values():
        source = p.read_text()
        skip = import_lines(source) if skip_imports else set()
        files[str(p.relative_to(tree))] = [(i + 1, s.strip()) for i, s in enumerate(source.splitlines())
                                           if s.strip() and i + 1 not in skip]
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = collections.defaultdict(list)
    for name, lines in files.items():
        for k in range(len(lines) - MIN_RUN + 1):
            windows[tuple(s for _, s in lines[k:k + MIN_RUN])].append((name, k))
    marked: dict[str, set[int]] = collections.defaultdict(set)
    for places in windows.values():
        if len(places) > 1:
            for name, k in places:
                marked[name].update(range(k, k + MIN_RUN))
    blocks = []
    for name, ks in marked.items():
        run: list[int] = []
        for k in [*sorted(ks), -2]:
            if run and k != run[-1] + 1:
                lines = files[name]
                blocks.append({"file": name, "from_line": lines[run[0]][0], "to_line": lines[run[-1]][0],
                               "lines": len(run)})
                run = []
            run.append(k)
    blocks.sort(key=lambda b: (-b["lines"], b["file"], b["from_line"]))
    return {"count": len(blocks), "lines": sum(b["lines"] for b in blocks), "blocks": blocks}


ROUTER_PROBE = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
start = time.perf_counter()
import cedserve.cli
import cedserve.router.server as server
assert cedserve.__file__.startswith(sys.argv[1]), cedserve.__file__
out = {"import_s": round(time.perf_counter() - start, 3),
       "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
       "torch": "torch" in sys.modules, "model_network": "cedserve.model.network" in sys.modules,
       "cedserve_modules": sum(1 for m in sys.modules if m.startswith("cedserve"))}
from cedserve.router.config import RouterConfig
start = time.perf_counter()
server._served_model(RouterConfig(checkpoint="", preset="tiny"))
out["served_model"] = {"load_s": round(time.perf_counter() - start, 3), "torch": "torch" in sys.modules,
                       "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
print(json.dumps(out))
"""


def installed_layout(tree: Path, rules: ModuleType, into: Path) -> Path:
    """A folder holding `cedserve/` as installed from TREE (symlinks through pyproject's
    `package-dir`, as scripts/typecheck.sh builds), so TREE imports without being installed."""
    package = into / "cedserve"
    package.mkdir()
    for entry in (tree / "cedserve").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in rules.package_folders(tree).items():
        parts = name.split(".")
        if len(parts) == 2 and not (package / parts[1]).exists():
            (package / parts[1]).symlink_to(folder)
    return into


def router_process(tree: Path, rules: ModuleType, repeats: int) -> dict[str, Any]:
    """The probe `repeats` times (the median import time; memory and torch of the last run)."""
    env = {**os.environ, "PYTHONPATH": ""}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = installed_layout(tree, rules, Path(tmp))
        for _ in range(repeats):
            out = subprocess.run([sys.executable, "-c", ROUTER_PROBE, str(path)], capture_output=True,
                                 text=True, env=env, cwd=tmp, check=True, timeout=300)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    times = sorted(r["import_s"] for r in runs)
    return {**runs[-1], "import_s": times[len(times) // 2], "import_s_runs": [r["import_s"] for r in runs],
            "entry": "import cedserve.cli, cedserve.router.server"}


def measure(tree: Path, repeats: int) -> dict[str, Any]:
    rules = layering()
    modules = rules.project_modules(tree)
    return {"modules": len(modules),
            "upward_imports": upward(tree, rules),
            "largest_files": largest(modules, tree),
            "duplicated_blocks": duplicated_blocks(modules, tree),
            "duplicated_blocks_without_imports": duplicated_blocks(modules, tree, skip_imports=True),
            "router_process": router_process(tree, rules, repeats)}


def render(figures: dict[str, Any]) -> str:
    up, dup, router = figures["upward_imports"], figures["duplicated_blocks"], figures["router_process"]
    code_dup = figures["duplicated_blocks_without_imports"]
    rows = [("modules", str(figures["modules"])),
            ("imports that run up", f"{up['count']} of {up['imports_total']}")]
    rows += [(f"  {pair}", str(n)) for pair, n in up["by_units"].items()]
    rows += [(f"largest: {f['file']}", str(f["lines"])) for f in figures["largest_files"]]
    rows += [("duplicated blocks (places, 6+ lines)", f"{dup['count']} ({dup['lines']} lines)"),
             ("  the same, imports left out", f"{code_dup['count']} ({code_dup['lines']} lines)"),
             ("router import time", f"{router['import_s']:.2f} s"),
             ("router ru_maxrss", f"{router['ru_maxrss_kib'] / 1024:.0f} MiB"),
             ("router imports torch", str(router["torch"])),
             ("router + preset model config: torch", str(router["served_model"]["torch"])),
             ("router + preset model config: ru_maxrss", f"{router['served_model']['ru_maxrss_kib'] / 1024:.0f} MiB")]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def commit(tree: Path) -> str:
    """TREE's HEAD commit, with `+dirty` when it has uncommitted changes ("" outside git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+dirty" if head and git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", default=str(HERE), help="root of a cedserve checkout")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--repeats", type=int, default=5, help="router probe runs (median import time)")
    args = parser.parse_args(argv)
    tree = Path(args.tree).resolve()
    figures = measure(tree, args.repeats)
    print(render(figures))
    if args.out:
        report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": "python benchmarks/structure.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "machine": {"python": platform.python_version(), "platform": platform.platform(),
                              "cpus": os.cpu_count()},
                  "tree": str(tree), "commit": commit(tree), **figures}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
