#!/usr/bin/env bash
# The GPU refresh on a machine without a package registry and with calls of at most 10 minutes
# (our H200; any CUDA GPU works): every notebook at full size (`python3 -m kernels_lib.workbench.report --device cuda`, which
# appends the sweeps to data/measured/), preceded by the hardening checks and the kernel tests on CUDA.
#
#   bash scripts/gpu_refresh.sh start OUT   # install the carried wheels, hardening + pytest on CUDA,
#                                            # then start the report in the background (setsid)
#   bash scripts/gpu_refresh.sh wait OUT    # wait for the report (up to ~9 min), pack reports and data
#
# SKIP_HARDENING=1 leaves out scripts/hardening_checks.py (when its results are already in hand).
# Both need KERNELS_LIB_COMMIT (the tree travels without .git) and the wheels in .whl/ (peers) and
# .whlnb/ (papermill, nbconvert, ipykernel, plotly, ipywidgets, trl and their needs the machine lacks).
# `wait` may be called again if the report is still running. What comes back under OUT:
# hardening CSVs, pytest_cuda.log, report.log, reports.tgz (HTML + executed notebooks) and
# measured.tgz (data/measured/ with the appended rows: unpack over the checkout and commit).
set -uo pipefail
action=${1:?start or wait}
out=${2:?OUT folder}
: "${KERNELS_LIB_COMMIT:?set KERNELS_LIB_COMMIT to the commit of this tree}"
export PYTHONPATH=/tmp/site:$PWD JUPYTER_PATH=/tmp/site/share/jupyter PYTHONUNBUFFERED=1
started=$(date +%s)

if [ "$action" = start ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whlnb/*.whl || exit 1
  python3 -c "import trl.experimental.orpo.orpo_trainer, papermill, nbconvert, plotly, liger_kernel, cut_cross_entropy" || exit 1
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.csv"
  [ "${SKIP_HARDENING:-0}" = 1 ] || python3 scripts/hardening_checks.py --out "$out" 2>&1 | tee "$out/hardening.log"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_numerics.py tests/test_kl_div.py \
    tests/test_fused_linear_cross_entropy.py tests/test_fused_linear_orpo.py tests/test_fused_linear_kto.py tests/test_half_gradients.py \
    > "$out/pytest_cuda.log" 2>&1
  echo "pytest on CUDA: exit $? ($(tail -1 "$out/pytest_cuda.log"))"
  setsid nohup python3 -m kernels_lib.workbench.report --device cuda --keep-going --out /tmp/reports > /tmp/report.log 2>&1 < /dev/null &
  echo "report started at $(date -u +%T)"
fi

while pgrep -f "kernels_lib.workbench.report" > /dev/null && [ $(( $(date +%s) - started )) -lt 560 ]; do sleep 5; done
cp /tmp/report.log "$out/report.log"
if pgrep -f "kernels_lib.workbench.report" > /dev/null; then
  echo "report still running: call 'wait' again"; tail -3 /tmp/report.log; exit 3
fi
tar czf "$out/reports.tgz" -C /tmp reports
tar czf "$out/measured.tgz" data/measured
echo "report done"; tail -8 /tmp/report.log
