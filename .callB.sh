export KERNELS_LIB_COMMIT=a2828fe PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/liger_kernel*.whl .whl/megatron_core*.whl 2>&1 | tail -2
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_target_totals.py tests/test_cross_entropy.py tests/test_vocab_parallel_cross_entropy.py -x > $OUT/pytest_cuda.log 2>&1; echo "pytest exit $?"; tail -2 $OUT/pytest_cuda.log
for chart in megatron_cross_entropy cross_entropy; do
  timeout 120 python3 -m kernels_lib.workbench.bench.cli $chart --values 4096,4096,16384,4096 --providers kernels_lib,torch --modes forward,full --dry-run 2>&1 | grep -E "speed" | awk '{print $0}' | cut -c1-200 > $OUT/dry_$chart.txt
  head -3 $OUT/dry_$chart.txt
done
timeout 100 python3 scripts/ce_small_vocab_profile.py --out $OUT --parts times,breakdown 2>&1 | tail -1
