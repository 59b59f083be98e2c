#!/usr/bin/env bash
# The GPU refresh on a machine without a package registry and with calls of at most 10 minutes (any CUDA
# GPU): the GPU test target and the ZeRO-3 check, then every notebook at full size
# (`python3 -m kernels_workbench.report --device cuda`, which appends the sweeps to data/measured/).
#
#   bash scripts/gpu_refresh.sh start OUT   # copy the tree to /tmp/kl, install the carried wheels, run the
#                                            # GPU target and the ZeRO-3 check, start the report (setsid)
#   bash scripts/gpu_refresh.sh wait OUT    # wait for the report (up to ~9 min a call), pack its results
#
# The tree is copied first: each call lays the working tree anew, which would break a job running from it.
# Needs KERNELS_LIB_COMMIT (the tree travels without .git) and the wheels in .whl/ (the peers, the notebook
# stack, trl, deepspeed). SKIP_TESTS=1 leaves out the target and the ZeRO-3 check; ONLY="02_kl_divergence ..."
# runs those notebooks alone. SNAPSHOT=.snap/tree.tgz (`git archive --format=tar.gz -o .snap/tree.tgz HEAD`,
# carried) runs that commit's tree rather than the working tree's. What comes back under OUT: the target's pytest logs and test_memory.csv,
# zero3_check.csv, report.log, index.tgz (the reports' index and run times) and measured.tgz
# (data/measured/ with the appended rows: unpack over the checkout and commit).
set -uo pipefail
action=${1:?start or wait}
out=${2:?OUT folder}
: "${KERNELS_LIB_COMMIT:?set KERNELS_LIB_COMMIT to the commit of this tree}"
export PYTHONPATH=/tmp/site:/tmp/kl:/tmp/kl/lab JUPYTER_PATH=/tmp/site/share/jupyter PYTHONUNBUFFERED=1 KERNELS_LIB_COMMIT
started=$(date +%s)

if [ "$action" = start ]; then
  rm -rf /tmp/kl && mkdir -p /tmp/kl || exit 1
  if [ -n "${SNAPSHOT:-}" ]; then  # a `git archive` of the commit: edits made here after it stay behind
    tar xzf "$SNAPSHOT" -C /tmp/kl && cp -r .whl /tmp/kl/ || exit 1
  else
    cp -r . /tmp/kl/ || exit 1
  fi
  cd /tmp/kl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -c "import trl.experimental.orpo.orpo_trainer, papermill, nbconvert, plotly, liger_kernel, cut_cross_entropy" || exit 1
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.csv"
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    python3 tests/gpu_target.py --out /tmp/gpu_tests > "$out/gpu_tests.log" 2>&1
    echo "GPU target: exit $? ($(grep '^gpu_tests: .* passed' "$out/gpu_tests.log" | tail -1))"
    for f in pytest.log pytest-alone.log test_memory.csv; do [ -f /tmp/gpu_tests/$f ] && cp /tmp/gpu_tests/$f "$out/"; done
    python3 scripts/zero3_check.py --out "$out" > "$out/zero3.log" 2>&1; echo "ZeRO-3 check: exit $?"
  fi
  only=(); [ -n "${ONLY:-}" ] && only=(--only $ONLY)
  setsid nohup python3 -m kernels_workbench.report --device cuda --keep-going --record-times --record --out /tmp/reports "${only[@]}" \
    > /tmp/report.log 2>&1 < /dev/null & echo $! > /tmp/report.pid
  echo "report started at $(date -u +%T)"
fi

cd /tmp/kl || exit 1
pid=$(cat /tmp/report.pid)
while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - started )) -lt 560 ]; do sleep 5; done
cp /tmp/report.log "$out/report.log"
tar czf "$out/measured.tgz" data/measured data/report_times.csv
if kill -0 "$pid" 2>/dev/null; then
  echo "report still running: call 'wait' again"; tail -3 /tmp/report.log; exit 3
fi
tar czf "$out/index.tgz" -C /tmp/reports --exclude='*.ipynb' --exclude='*.html' . 2>/dev/null; cp /tmp/reports/index.html "$out/" 2>/dev/null
echo "report done"; tail -8 /tmp/report.log
