#!/usr/bin/env bash
# The main job on the embedded default: set up, start the whole system on this machine (router,
# prefill worker, decode worker: real processes, real gRPC and NIXL), stream one answer through the
# public API, then keep serving until Ctrl-C. Extra arguments go to `cedserve serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
port=${CEDSERVE_PORT:-50051}
http_port=${CEDSERVE_HTTP_PORT:-8000}
log=$(mktemp -t cedserve-serve.XXXXXX)
cedserve serve --port "$port" --http-port "$http_port" "$@" > >(tee "$log") 2>&1 &
serve_pid=$!
trap 'kill -INT $serve_pid 2>/dev/null; wait $serve_pid' INT TERM
for _ in $(seq 600); do
  grep -q '^CEDSERVE_READY' "$log" && break
  kill -0 $serve_pid 2>/dev/null || { echo "cedserve serve exited before it was ready"; exit 1; }
  sleep 0.5
done
echo '$ cedserve generate "def fibonacci(" --max-tokens 32'
cedserve generate "def fibonacci(" --address "127.0.0.1:$port" --max-tokens 32 -v
echo "Serving on 127.0.0.1:$port (gRPC) and http://127.0.0.1:$http_port/v1 (OpenAI-compatible HTTP); Ctrl-C stops everything."
wait $serve_pid
