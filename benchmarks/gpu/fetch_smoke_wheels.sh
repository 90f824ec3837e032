#!/usr/bin/env bash
# The wheels benchmarks/gpu/gpu_smoke.py carries to a GPU machine without pydantic and without network: pydantic and
# its dependencies at the versions constraints.txt pins, built for CPython 3.12 on x86-64 Linux (the borrowed
# H200 machine's Python). Run where PyPI is reachable; they land in benchmarks/gpu/wheels/ (git-ignored: pass it in
# the device run's `carry`). About 2.9 MB: pydantic 0.49 MB, pydantic_core 2.26 MB (compiled), annotated_types
# 0.01 MB, typing_inspection 0.01 MB, typing_extensions 0.05 MB: pydantic needs a newer one than the lent
# machine's torch brought, and the carried wheels come first on sys.path. `make gpu-twin` rehearses exactly that.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
pin() { grep -i "^$1==" "$REPO/constraints.txt" | head -1; }
mkdir -p "$REPO/benchmarks/gpu/wheels"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$REPO/benchmarks/gpu/wheels" \
  "$(pin pydantic)" "$(pin pydantic_core)" "$(pin annotated-types)" "$(pin typing-inspection)" \
  "$(pin typing_extensions)"
ls -l "$REPO/benchmarks/gpu/wheels"
