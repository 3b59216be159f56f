#!/usr/bin/env bash
# The test suite: bootstraps the patched wheel and moecache, then runs pytest.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/scripts/bootstrap.sh"
cd "$repo"
exec "${PYTHON:-python3}" -m pytest -q "$@"
