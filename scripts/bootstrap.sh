#!/usr/bin/env bash
# Install what run.py and the tests need into the current Python: the moecache-patched
# llama-cpp-python wheel (built by scripts/build_wheel.sh, skipped when up to date) and the
# moecache package (editable, with its test extra).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-python3}  # the interpreter to install into (run.py passes its own)

"$repo/scripts/build_wheel.sh" "$@"
wheel=$(ls "$repo"/dist/llama_cpp_python-*+moecache.*.whl)
"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "$wheel"
"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -e "$repo[test]"
"$python" -c "import llama_cpp, moecache.live.native as n; print('bootstrap: llama_cpp', llama_cpp.__version__, 'patch series', n.patch_version())"
