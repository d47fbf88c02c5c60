#!/usr/bin/env bash
# GPU check of the KV page storage (well under 3 minutes): records the environment, runs the
# storage tests (the CUDA ones included; skips are listed with their reason) and
# scripts/bench_storage.py, and writes everything under $OUT (default: ./device_check_out).
# Installs nothing: the repository is put on PYTHONPATH; torch (a CUDA build), pydantic,
# pytest, pytest-timeout and hypothesis must already be importable.
#
#   OUT=/tmp/results bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./device_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

python3 - >"$OUT/env.txt" 2>&1 <<'PY' || status=1
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
PY
cat "$OUT/env.txt"

echo "== storage tests"
timeout 120 python3 -m pytest -q -rs \
    tests/test_storage.py tests/test_storage_manager.py tests/test_recompute.py \
    --junitxml="$OUT/storage_tests.xml" 2>&1 | tee "$OUT/storage_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== bench_storage"
timeout 90 python3 scripts/bench_storage.py --json "$OUT/bench_storage.json" 2>&1 \
    | tee "$OUT/bench_storage.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "device_check exit status: $status" | tee "$OUT/status.txt"
exit "$status"
