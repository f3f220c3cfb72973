# Sourced by the scripts/gpu_*.sh recipes. On a CUDA host the project is not installed, and
# setuptools' package-dir mapping (router/ -> cedserve.router, ...) does not exist there: this makes
# a folder of symlinks in which `cedserve.*` imports as installed. Run python with -P (or
# PYTHONSAFEPATH=1) from the repo root so the checkout's own cedserve/ folder does not shadow it.
make_gpu_tree() {  # $1: tree folder (replaced)
  rm -rf "$1" && mkdir -p "$1/cedserve"
  local f pkg
  for f in cedserve/*; do ln -s "$PWD/$f" "$1/cedserve/$(basename "$f")"; done
  for pkg in model kernels kv_transfer prefill_workers decode_workers router proto; do
    [ -d "$pkg" ] && ln -s "$PWD/$pkg" "$1/cedserve/$pkg"
  done
  return 0
}

install_gpu_wheels() {  # $1: python; carried wheels (build/gpu_wheels) into build/gpu_site, if any
  if ls build/gpu_wheels/*.whl >/dev/null 2>&1; then
    "$1" -m pip install --quiet --upgrade --no-deps --no-index --target build/gpu_site build/gpu_wheels/*.whl
  fi
}
