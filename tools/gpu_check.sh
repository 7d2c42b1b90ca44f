#!/usr/bin/env bash
# The GPU checks in one call, for a machine with CUDA and PyTorch but no
# package index (flashinfer travels as wheels).
#
#   tools/gpu_check.sh fetch             # where pip reaches PyPI: the wheels into .whl/
#   tools/gpu_check.sh run [BASE_DIR]    # on the GPU machine, from the repository root
#
# run: installs .whl/*.whl into /tmp/site; runs the GPU tests (pytest -m gpu);
# writes a random-weight Llama-3-8B checkpoint to /tmp/l8b (made on the GPU,
# in the background while the tests run); runs tools/bench_gpu.py at batches
# 1, 64 and 256 (GPU_CHECK_BATCHES), each with the overlap schedule on and
# off. Given BASE_DIR, an older tree
# (`git archive REV | tar -x -C BASE_DIR`), it then runs the sweep at 64 and
# 256 twice for each tree, interleaved, so that the two compare on one
# machine. With time left, `bench offline` against transformers. Reports go
# to $OUT (or ./gpu-out); GPU_CHECK_SECONDS (540) bounds the whole run.
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = fetch ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl flashinfer-python==0.6.1 apache-tvm-ffi==0.1.15.post2
  exit
fi
[ "${1:-}" = run ] || { sed -n 2,15p "$0"; exit 2; }
BASE=${2:-}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
T0=$(date +%s)
LIMIT=${GPU_CHECK_SECONDS:-540}
left() { echo $(( $1 * LIMIT / 540 - ($(date +%s) - T0) )); }  # seconds until a point of the budget
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# the package's folders under stepserve/, as pyproject.toml maps them (no install: nothing to fetch there)
for root in . ${BASE:+"$BASE"}; do
  for d in engine kvcache scheduler server traces; do ln -sfn ../$d "$root/stepserve/$d"; done
done
[ -n "$BASE" ] && [ ! -d "$BASE/engine/assets" ] && cp -r engine/assets "$BASE/engine/"
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONPATH=/tmp/site python3 -c "import torch, transformers, flashinfer; print(torch.__version__, transformers.__version__, flashinfer.__version__)"
if [ ! -f /tmp/l8b/config.json ]; then
  (PYTHONPATH=/tmp/site:$PWD python3 tools/bench_gpu.py --model /tmp/l8b --make llama3-8b --make-only > "$OUT/make.log" 2>&1) &
fi
PYTHONPATH=/tmp/site:$PWD timeout "$(left 230)" pytest -q -m gpu -p no:cacheprovider tests/test_gpu_path.py 2>&1 | tail -25
echo "== tests done at $(( $(date +%s) - T0 )) s"
wait
sweep() {  # sweep TREE BATCHES NAME [bench_gpu.py options]
  local tree=$1 batches=$2 name=$3
  shift 3
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "$(left 400)" python3 tools/bench_gpu.py --model /tmp/l8b \
    --batches "$batches" --prefill-prompts 8 --out "$OUT/$name.json" "$@" 2>&1 | grep -v Warning)
}
# the overlap schedule against the plain one, each batch size with both, in one process
sweep . "${GPU_CHECK_BATCHES:-1,64,256}" sweep --overlap-schedules on,off
if [ -n "$BASE" ]; then
  for i in 1 2; do sweep "$BASE" 64,256 base$i; sweep . 64,256 new$i; done
fi
echo "== sweeps done at $(( $(date +%s) - T0 )) s"
if [ "$(left 540)" -gt 100 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout "$(left 540)" python3 -m stepserve.cli bench offline --model /tmp/l8b \
    --dtype bfloat16 --num-prompts 256 --concurrency 64 --output-len 128 --repeats 1 --kv-memory-gb 20 \
    --skip-hf-continuous --overhead-rows 64 --overhead-steps 10 --out "$OUT/offline.json" 2>&1 | grep -v Warning | tail -14
fi
echo "== done at $(( $(date +%s) - T0 )) s"
