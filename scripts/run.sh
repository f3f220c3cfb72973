#!/usr/bin/env bash
# The main job on the embedded default: set up, then run cedserve on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/cedserve inspect --preset v4.1-flash "$@"
