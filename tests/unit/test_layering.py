"""The import direction of the package (docs/architecture.md): every `cedserve.*` import of every
project module, module-level and function-level alike, points down the layer table or stays inside
its own unit; and the router's process starts without torch.

Function-level imports count: they are how a module reaches a heavy or optional part lazily, but
they are dependencies all the same (a lazy import upward still ties the lower layer to the upper
one). `TYPE_CHECKING` imports count for the same reason.

`benchmarks/structure.py` reports the same figures (upward imports, with this table) before and after
a change; it loads the table and the parser from here so the figure and the rule cannot drift.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

LAYERS: tuple[tuple[str, ...], ...] = (
    # bottom: leaves and the generated wire code; they import nothing of the project but themselves
    ("cedserve.common", "cedserve.proto"),
    ("cedserve.kernels",),
    ("cedserve.model",),
    ("cedserve.kv_transfer",),
    ("cedserve.serving",),
    # the applications: the three serving processes and the trainer; none imports another's internals
    ("cedserve.prefill_workers", "cedserve.decode_workers", "cedserve.router", "cedserve.training"),
    # top: the CLI, launchers, client, serving benchmark (every other module of the `cedserve/` folder)
    ("cedserve",),
)
"""Units by layer, bottom first. A module belongs to the unit whose name is its longest dotted
prefix. An import may go to its own unit or to a unit of a lower layer; one to a higher layer, or to
another unit of the same layer, runs up."""

GENERATED = ("_pb2.py", "_pb2_grpc.py")


def package_folders(root: Path) -> dict[str, Path]:
    """Every package pyproject installs -> its folder (through `package-dir`)."""
    import tomllib

    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    folders = {}
    for package in setuptools["packages"]:
        base = max((k for k in package_dir if package == k or package.startswith(k + ".")), key=len)
        rest = package[len(base):].lstrip(".").replace(".", "/")
        folders[package] = root / package_dir[base] / rest
    return folders


def project_modules(root: Path) -> dict[str, Path]:
    """Every module of the installed package (generated protobuf code left out) -> its file."""
    modules: dict[str, Path] = {}
    for package, folder in package_folders(root).items():
        for path in sorted(folder.glob("*.py")):
            if path.name.endswith(GENERATED):
                continue
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def unit_of(module: str) -> str:
    """The longest unit of `LAYERS` that `module` lies in."""
    best = ""
    for units in LAYERS:
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
                best = unit
    if not best:
        raise ValueError(f"{module} lies in no unit of the layer table")
    return best


def layer_of(unit: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit in units)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int

    @property
    def runs_up(self) -> bool:
        src, dst = unit_of(self.importer), unit_of(self.imported)
        return src != dst and layer_of(dst) >= layer_of(src)

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} -> {self.imported}"


def module_imports(module: str, path: Path) -> Iterator[Import]:
    """Every `cedserve.*` import in the file, at any depth (functions, `TYPE_CHECKING` blocks)."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from cedserve import proto`, `from . import metrics`: the names are modules
            whole = base == "cedserve" or (node.level > 0 and not node.module)
            names = [f"{base}.{alias.name}" if whole else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == "cedserve" or name.startswith("cedserve."):
                yield Import(module, name, node.lineno)


def all_imports(root: Path) -> list[Import]:
    return [imp for module, path in project_modules(root).items() for imp in module_imports(module, path)]


def upward_imports(root: Path) -> list[Import]:
    return [imp for imp in all_imports(root) if imp.runs_up]


# ------------------------------------------------------------------ tests


def test_every_module_lies_in_a_unit_of_the_table() -> None:
    modules = project_modules(REPO)
    assert len(modules) > 100
    for module in modules:
        unit_of(module)


def test_no_import_runs_up() -> None:
    upward = upward_imports(REPO)
    assert not upward, "imports that run up the layer table:\n" + "\n".join(map(str, upward))


def test_the_parser_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("import os\n"
                      "from cedserve.model.config import ModelConfig\n"
                      "def f():\n"
                      "    from cedserve.router import server\n"
                      "    from . import metrics\n"
                      "from cedserve import proto\n")
    found = {(i.imported, i.line) for i in module_imports("cedserve.kv_transfer.probe", source)}
    assert found == {("cedserve.model.config", 2), ("cedserve.router", 4), ("cedserve.kv_transfer.metrics", 5),
                     ("cedserve.proto", 6)}
    ups = [i for i in module_imports("cedserve.kv_transfer.probe", source) if i.runs_up]
    assert [i.imported for i in ups] == ["cedserve.router"]


def test_peers_of_one_layer_do_not_import_each_other() -> None:
    assert Import("cedserve.router.server", "cedserve.decode_workers.config", 1).runs_up
    assert Import("cedserve.common.tls", "cedserve.proto", 1).runs_up
    assert not Import("cedserve.router.server", "cedserve.router.config", 1).runs_up
    assert not Import("cedserve.cli", "cedserve.router.config", 1).runs_up


ROUTER_PROBE = """
import json, sys
import cedserve.cli, cedserve.router.server as server
from cedserve.router.config import RouterConfig
imported = {"torch": "torch" in sys.modules, "network": "cedserve.model.network" in sys.modules}
model, codec = server._served_model(RouterConfig(checkpoint="", preset="tiny"))
served = {"torch": "torch" in sys.modules, "network": "cedserve.model.network" in sys.modules,
          "vocab_size": model.vocab_size}
print(json.dumps({"imported": imported, "served": served}))
"""


def test_the_router_process_imports_no_torch() -> None:
    """What `cedserve router` imports (the CLI, then the router's server), and its loading of a
    preset's config and tokenizer, leave torch and the network out: the router needs the model's
    config, tokenizer and KV accounting, never its weights."""
    out = subprocess.run([sys.executable, "-c", ROUTER_PROBE], capture_output=True, text=True, check=True,
                         cwd=REPO, timeout=120)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["imported"] == {"torch": False, "network": False}
    assert report["served"]["vocab_size"] > 0
    assert (report["served"]["torch"], report["served"]["network"]) == (False, False)
