#!/usr/bin/env bash
# Generate Python code for every proto/*.proto (package cedserve.v1) into proto/ (or into $1).
#
# Output per file X.proto: X_pb2.py, X_pb2.pyi, X_pb2_grpc.py. Imports between generated modules are
# rewritten to `from cedserve.proto import X_pb2`, because proto/ installs as `cedserve.proto`.
# Adding a service is: drop a .proto file into proto/, run this script, commit the outputs.
# tests/unit/test_proto_fresh.py regenerates into a temporary folder and fails if the checked-in
# files differ, so run this after any .proto change (with the pinned grpcio-tools from the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-proto}
py=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then py=.venv/bin/python; fi
mkdir -p "$out"
shopt -s nullglob
sources=(proto/*.proto)
if [ ${#sources[@]} -eq 0 ]; then echo "gen_proto: no proto/*.proto" >&2; exit 1; fi
"$py" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "${sources[@]}"
for f in "$out"/*_pb2.py "$out"/*_pb2.pyi "$out"/*_pb2_grpc.py; do
  # `import foo_pb2 as foo__pb2` -> `from cedserve.proto import foo_pb2 as foo__pb2`
  sed -i -E 's/^import ([A-Za-z0-9_]+_pb2)( as .*)?$/from cedserve.proto import \1\2/' "$f"
done
