#!/usr/bin/env bash
# mypy (strict) over the package as it is imported: cedserve.model, cedserve.kernels, ...
# The top-level folders map into the `cedserve.*` namespace through setuptools' package-dir, which mypy
# cannot follow, so build a tree of symlinks with the installed layout and check that.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree"; mkdir -p "$tree/cedserve"
for f in cedserve/*; do ln -s "$PWD/$f" "$tree/cedserve/$(basename "$f")"; done
for pkg in common model kernels kv_transfer serving prefill_workers decode_workers router proto training; do
  ln -s "$PWD/$pkg" "$tree/cedserve/$pkg"
done
cd "$tree" && exec mypy --config-file ../../pyproject.toml -p cedserve
