#!/usr/bin/env bash
# Every GPU check in one run (about 5 minutes on one H200): the CUDA tests (the two-GPU ones need two GPUs), then
# bench/gpu_check.py.
#
#   OUT=results/gpu_checks bash bench/gpu_checks.sh
#
# CHECK_ARGS adds arguments to gpu_check.py (e.g. "--batch 16"). Installs nothing: the interpreter in PYTHON (default python3) must have torch with CUDA, lightning, transformers,
# numba and pulp. Logs and results go under $OUT; the pytest summary and gpu_check's table are printed last.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-results/gpu_checks}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{ date -u; nvidia-smi; nproc; free -g; } >"$OUT/machine.txt" 2>&1
$PY -c "import torch, lightning, transformers, numba, pulp; print('torch', torch.__version__, '| lightning',
lightning.__version__, '| transformers', transformers.__version__, '| numba', numba.__version__, '| pulp',
pulp.__version__, '|', torch.cuda.get_device_name(0))" 2>&1 | tee -a "$OUT/machine.txt"

# SIGINT at the limit: pytest stops the running test and still prints what passed and failed so far
timeout -s INT -k 20 "${TEST_TIMEOUT:-270}" $PY -m pytest -q -p no:cacheprovider -m gpu -rfE \
  tests/runtime/lanes/test_streams.py tests/integration/test_cuda.py >"$OUT/pytest_gpu.log" 2>&1
tests_rc=$?
timeout "${CHECK_TIMEOUT:-300}" $PY bench/gpu_check.py --out "$OUT" ${CHECK_ARGS:-} >"$OUT/gpu_check.log" 2>&1
check_rc=$?

echo "== CUDA tests (exit $tests_rc; full log $OUT/pytest_gpu.log)"
grep -E "^(FAILED|ERROR)|passed|failed|skipped|error" "$OUT/pytest_gpu.log" | tail -15
echo "== gpu_check (exit $check_rc; full log $OUT/gpu_check.log)"
tail -12 "$OUT/gpu_check.log"
exit $((tests_rc || check_rc))
