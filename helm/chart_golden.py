"""Render the cedserve chart offline and keep its golden renders in step.

Rendering goes through `helm-python-sdk` (Helm v4's Go SDK compiled into a shared library that
ships in the wheel: no helm binary, no cluster, no network). The golden files under
`helm/cedserve/golden/` hold one render per value set: the chart defaults and each file in
`helm/cedserve/examples/`. `tests/unit/test_helm_chart.py` compares against them; after changing
the chart, run `helm/regen-golden.sh` and review the diff.

    python helm/chart_golden.py           # rewrite the golden files
    python helm/chart_golden.py --check   # exit 1 if any golden file is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

HELM_DIR = Path(__file__).resolve().parent
CHART_DIR = HELM_DIR / "cedserve"
EXAMPLES_DIR = CHART_DIR / "examples"
GOLDEN_DIR = CHART_DIR / "golden"
RELEASE = "ced"
NAMESPACE = "serving"
DEFAULT = "default"
# Generated secrets differ on every render; golden files hold this instead.
GENERATED = "<generated>"


def value_sets() -> dict[str, dict[str, Any]]:
    """`default` (no overrides) and one entry per `examples/<name>.yaml`."""
    sets: dict[str, dict[str, Any]] = {DEFAULT: {}}
    for path in sorted(EXAMPLES_DIR.glob("*.yaml")):
        sets[path.stem] = yaml.safe_load(path.read_text()) or {}
    return sets


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template RELEASE -n NAMESPACE` would produce."""
    import helm_python

    with helm_python.Chart.load(CHART_DIR) as chart:
        return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def documents(manifests: dict[str, str]) -> list[tuple[str, str]]:
    """(template path, YAML document) for every non-empty document, sorted by path; NOTES.txt left out."""
    out: list[tuple[str, str]] = []
    for path in sorted(manifests):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in re.split(r"^---\s*$", manifests[path], flags=re.MULTILINE):
            body = doc.strip("\n")
            if yaml.safe_load(body) is not None:
                out.append((path, _mask_generated(path, body)))
    return out


def objects(manifests: dict[str, str]) -> list[dict[str, Any]]:
    """Every rendered Kubernetes object, parsed."""
    return [yaml.safe_load(doc) for _, doc in documents(manifests)]


def _mask_generated(path: str, doc: str) -> str:
    if not path.endswith(("templates/secret-api-key.yaml", "templates/secret-kv-transfer.yaml")):
        return doc
    return re.sub(r'^(  [-._a-zA-Z0-9]+: )".*"$', rf'\1"{GENERATED}"', doc, flags=re.MULTILINE)


def golden_text(manifests: dict[str, str]) -> str:
    parts = [f"---\n# Source: {path}\n{doc}\n" for path, doc in documents(manifests)]
    return "".join(parts)


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    args = parser.parse_args(argv)
    GOLDEN_DIR.mkdir(exist_ok=True)
    stale = []
    for name, values in value_sets().items():
        text = golden_text(render(values))
        path = golden_path(name)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(HELM_DIR.parent)}")
    known = {golden_path(name) for name in value_sets()}
    orphans = sorted(set(GOLDEN_DIR.glob("*.yaml")) - known)
    for path in orphans:
        if args.check:
            stale.append(path)
        else:
            path.unlink()
            print(f"removed {path.relative_to(HELM_DIR.parent)}")
    for path in stale:
        print(f"stale golden render: {path} (run helm/regen-golden.sh)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
