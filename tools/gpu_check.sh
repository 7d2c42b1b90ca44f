#!/usr/bin/env bash
# The GPU checks in one command, for a machine with CUDA and PyTorch but no
# package index (flashinfer travels as wheels).
#
#   tools/gpu_check.sh fetch             # where pip reaches PyPI: the wheels into .whl/
#   tools/gpu_check.sh run [BASE_DIR]    # on the GPU machine, from the repository root
#   tools/gpu_check.sh validate TRACE    # on the GPU machine: the simulator against the server there
#   tools/gpu_check.sh brief TRACE       # on the GPU machine: what matters most, in a short time (below)
#
# brief: the GPU tests; then tools/bench_gpu.py on a random Llama-3-8B
# checkpoint (the decode step at 64 rows, greedy and sampled with the sampler's
# Triton kernel on and off, and a torch profile); then `validate` on TRACE on
# the GPU_VALIDATE_SHAPE checkpoint with what is left of GPU_CHECK_SECONDS. Logs go to
# GPU_CHECK_LOGS (/tmp/gpu-logs), packed at the end with the server's step log
# into $OUT/logs.tgz (one file: $OUT keeps the rest of its 8 for validate's
# reports).
#
# fetch: flashinfer, and the server's and the tests' packages that the GPU
# image lacks (fastapi, uvicorn, openai, llguidance and their needs: ~10 MB),
# so that the whole suite and `stepserve serve` run there.
#
# validate (issue 14's check on a GPU profile): writes a random-weight
# checkpoint (GPU_VALIDATE_SHAPE, default qwen2.5-1.5b; `embedded` serves the
# embedded model instead, for trying this script on a CPU), serves it with a
# step log, profiles it over HTTP, then `stepserve validate` on TRACE (a file
# in the checkout, carried: ../shared does not travel) at GPU_VALIDATE_RATES,
# with GPU_VALIDATE_ARGS (trace scaling and SLOs). Reports go to $OUT, each
# real run as it ends into $OUT/replays (`validate --replays`: a run cut short
# keeps them, and the simulation can be redone on any machine); the logs to
# GPU_CHECK_LOGS (default $OUT). To try
# it on a CPU: GPU_CHECK_WHEELS= GPU_VALIDATE_SHAPE=embedded, and small rates.
#
# run: installs .whl/*.whl into /tmp/site; runs the GPU tests (pytest -m gpu);
# writes a random-weight Llama-3-8B checkpoint to /tmp/l8b (made on the GPU,
# in the background while the tests run); runs tools/bench_gpu.py at batches
# 1, 64 and 256 (GPU_CHECK_BATCHES), each with the overlap schedule on and
# off, and an idle engine given 4 prompts at once, with a torch profile of it
# (`--profile-entry`). Given BASE_DIR, an older tree
# (`git archive REV | tar -x -C BASE_DIR`), it then runs the sweep at 64 and
# 256 twice for each tree, interleaved, so that the two compare on one
# machine. With time left, `bench offline` against transformers. Reports go
# to $OUT (or ./gpu-out); GPU_CHECK_SECONDS (540) bounds the whole run.
#
# Every mode: flashinfer compiles its kernels on first use (~3 minutes on a
# fresh machine). GPU_CHECK_SAVE_JIT=1 returns that cache as $OUT/fiws.tgz.part*
# (15 MiB parts); copied into .gpu/ (GPU_CHECK_JIT) beside the checkout, a later
# run on a fresh machine unpacks it first.
set -u
cd "$(dirname "$0")/.."
PLATFORM="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
if [ "${1:-}" = fetch ]; then
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: $PLATFORM \
    -d .whl flashinfer-python==0.6.1 apache-tvm-ffi==0.1.15.post2 || exit 1
  # shellcheck disable=SC2086
  python3 -m pip download -q --only-binary=:all: $PLATFORM -d .whl \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 uvicorn==0.54.0 httptools openai==3.57.0 llguidance
  exit
fi
case "${1:-}" in run|validate|brief) ;; *) sed -n 2,45p "$0"; exit 2 ;; esac
MODE=$1
BASE=${2:-}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
T0=$(date +%s)
LIMIT=${GPU_CHECK_SECONDS:-540}
left() { echo $(( $1 * LIMIT / 540 - ($(date +%s) - T0) )); }  # seconds until a point of the budget
WHEELS=${GPU_CHECK_WHEELS-.whl}  # (empty: install nothing, e.g. to try `validate` on a CPU machine)
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
fi
# the package's folders under stepserve/, as pyproject.toml maps them (no install: nothing to fetch there)
[ "$MODE" = run ] || BASE=
for root in . ${BASE:+"$BASE"}; do
  for d in engine kvcache scheduler server traces; do ln -sfn ../$d "$root/stepserve/$d"; done
done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
# flashinfer's JIT builds take ~3 minutes on a fresh machine (an H200): a cache kept from an
# earlier run (GPU_CHECK_SAVE_JIT=1 writes it to $OUT as fiws.tgz.part*; copy those into .gpu/ with the checkout)
# is unpacked first
JIT=${GPU_CHECK_JIT:-.gpu}
if ls "$JIT"/fiws.tgz.part* > /dev/null 2>&1; then
  cat "$JIT"/fiws.tgz.part* | tar -xz -C /tmp && echo "== flashinfer JIT cache unpacked ($(du -sh /tmp/fiws | cut -f1))"
fi
save_jit() {  # the JIT cache into $OUT in parts of 15 MiB (a returned file's limit is 16)
  [ "${GPU_CHECK_SAVE_JIT:-0}" = 1 ] && [ -d /tmp/fiws ] || return 0
  tar -cz -C /tmp fiws | split -b 15M -d - "$OUT/fiws.tgz.part"
  ls -la "$OUT"/fiws.tgz.part*
}
trap save_jit EXIT
if [ "$MODE" = brief ]; then
  TRACE=${2:?brief TRACE: a trace file inside the checkout}
  LOGS=${GPU_CHECK_LOGS:-/tmp/gpu-logs}
  mkdir -p "$LOGS"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  SHAPE=${GPU_VALIDATE_SHAPE:-qwen2.5-1.5b}
  [ -f "/tmp/$SHAPE/config.json" ] || (python3 tools/bench_gpu.py --model "/tmp/$SHAPE" --make "$SHAPE" --make-only \
    > "$LOGS/make.log" 2>&1 &)
  [ -f /tmp/l8b/config.json ] || (python3 tools/bench_gpu.py --model /tmp/l8b --make llama3-8b --make-only \
    > "$LOGS/make8b.log" 2>&1 &)
  # 1. the GPU tests (they build most of flashinfer's kernels on a fresh machine)
  timeout "$(left 230)" pytest -q -m gpu -p no:cacheprovider -rfE tests/test_gpu_path.py tests/test_triton_sampling.py > "$LOGS/tests.log" 2>&1
  tail -15 "$LOGS/tests.log"
  echo "== tests done at $(( $(date +%s) - T0 )) s"
  # 2. the 8B decode step at 64 rows against its floor, greedy and sampled (the sampler's Triton kernel on and
  # off), with a torch profile of where its GPU time goes (the tables into the logs)
  for _ in $(seq 60); do [ -f /tmp/l8b/config.json ] && break; sleep 1; done
  timeout "$(left 340)" python3 tools/bench_gpu.py --model /tmp/l8b --batches 64 --overlap-schedules on \
    --temperatures 0,1 --sampler-kernels on,off --profile-batches 64 --prefill-prompts 0 --entry-rows 0 \
    --steps 16 --kv-memory-gb 40 --out "$LOGS/decode8b.json" > "$LOGS/decode8b.log" 2>&1
  grep -E "^decode|graph GPU|copy bandwidth|Error" "$LOGS/decode8b.log"
  echo "== 8B decode done at $(( $(date +%s) - T0 )) s"
  # 3. the simulator against the server (issue 14), with what is left; each real run lands in $OUT/replays
  GPU_CHECK_WHEELS= GPU_CHECK_JIT=/nonexistent GPU_CHECK_SAVE_JIT=0 GPU_CHECK_LOGS="$LOGS" \
    GPU_VALIDATE_PLOT="$LOGS/validate.png" GPU_VALIDATE_RATES="${GPU_VALIDATE_RATES:-16,32,64,128,256}" \
    GPU_PROFILE_ARGS="${GPU_PROFILE_ARGS:---rounds 3}" timeout "$(left 525)" "$0" validate "$TRACE"
  echo "== brief done at $(( $(date +%s) - T0 )) s"
  # the server's step log too: `validate --step-log` against the stored runs then works on any machine
  [ -f /tmp/steps.jsonl ] && cp /tmp/steps.jsonl "$LOGS/"
  tar -czf "$OUT/logs.tgz" -C "$LOGS" . && echo "== logs in \$OUT/logs.tgz ($(du -h "$OUT/logs.tgz" | cut -f1))"
  exit
fi
if [ "$MODE" = validate ]; then
  LOGS=${GPU_CHECK_LOGS:-$OUT}  # make.log, serve.log (elsewhere than $OUT where its 8 files are needed)
  TRACE=${2:?validate TRACE: a trace file inside the checkout}
  SHAPE=${GPU_VALIDATE_SHAPE:-qwen2.5-1.5b}
  PORT=${GPU_VALIDATE_PORT:-8311}
  KVGB=${GPU_VALIDATE_KV_GB:-40}  # the KV pool, the same for the server and its profile
  URL=http://127.0.0.1:$PORT
  MODEL=()
  if [ "$SHAPE" != embedded ]; then
    [ -f "/tmp/$SHAPE/config.json" ] || python3 tools/bench_gpu.py --model "/tmp/$SHAPE" --make "$SHAPE" --make-only \
      > "$LOGS/make.log" 2>&1 || { tail "$LOGS/make.log"; exit 1; }
    MODEL=(--model "/tmp/$SHAPE")
  fi
  STEPS=/tmp/steps.jsonl  # (large: kept off $OUT)
  rm -f "$STEPS"
  python3 -m stepserve.cli serve "${MODEL[@]}" --port "$PORT" --step-log "$STEPS" --enable-prompt-tokens-details --kv-memory-gb "$KVGB" \
    > "$LOGS/serve.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2> /dev/null; save_jit' EXIT
  for _ in $(seq 600); do
    python3 -c "import urllib.request as u; u.urlopen('$URL/health', timeout=1)" 2> /dev/null && break
    kill -0 $SERVER 2> /dev/null || { tail -20 "$LOGS/serve.log"; exit 1; }
    sleep 1
  done
  echo "== serving at $(( $(date +%s) - T0 )) s"
  python3 -m stepserve.cli profile --url "$URL" --step-log "$STEPS" --out "$OUT/profile.json" --kv-memory-gb "$KVGB" ${GPU_PROFILE_ARGS:-} --no-progress \
    2>&1 | tail -20
  echo "== profiled at $(( $(date +%s) - T0 )) s"
  # shellcheck disable=SC2086
  python3 -m stepserve.cli validate --trace "$TRACE" ${GPU_VALIDATE_ARGS:---limit 400 --slo-ttft 0.2 --slo-tpot 0.02} \
    --rates "${GPU_VALIDATE_RATES:-8,16,32,48,64,96}" --profile "$OUT/profile.json" --url "$URL" --step-log "$STEPS" \
    --replays "$OUT/replays" --out "$OUT/validate.json" --plot "${GPU_VALIDATE_PLOT:-$OUT/validate.png}" \
    --no-progress 2>&1
  echo "== done at $(( $(date +%s) - T0 )) s"
  exit
fi
[ -n "$BASE" ] && [ ! -d "$BASE/engine/assets" ] && cp -r engine/assets "$BASE/engine/"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONPATH=/tmp/site python3 -c "import torch, transformers, flashinfer; print(torch.__version__, transformers.__version__, flashinfer.__version__)"
if [ ! -f /tmp/l8b/config.json ]; then
  (python3 tools/bench_gpu.py --model /tmp/l8b --make llama3-8b --make-only > "$OUT/make.log" 2>&1) &
fi
timeout "$(left 230)" pytest -q -m gpu -p no:cacheprovider tests/test_gpu_path.py tests/test_triton_sampling.py 2>&1 | tail -25
echo "== tests done at $(( $(date +%s) - T0 )) s"
wait
sweep() {  # sweep TREE BATCHES NAME [bench_gpu.py options]
  local tree=$1 batches=$2 name=$3
  shift 3
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "$(left 400)" python3 tools/bench_gpu.py --model /tmp/l8b \
    --batches "$batches" --prefill-prompts 8 --out "$OUT/$name.json" "$@" 2>&1 | grep -v Warning)
}
# the overlap schedule against the plain one, each batch size with both, in one process
sweep . "${GPU_CHECK_BATCHES:-1,64,256}" sweep --overlap-schedules on,off --profile-entry
if [ -n "$BASE" ]; then
  for i in 1 2; do sweep "$BASE" 64,256 base$i; sweep . 64,256 new$i; done
fi
echo "== sweeps done at $(( $(date +%s) - T0 )) s"
if [ "$(left 540)" -gt 100 ]; then
  timeout "$(left 540)" python3 -m stepserve.cli bench offline --model /tmp/l8b \
    --dtype bfloat16 --num-prompts 256 --concurrency 64 --output-len 128 --repeats 1 --kv-memory-gb 20 \
    --skip-hf-continuous --overhead-rows 64 --overhead-steps 10 --out "$OUT/offline.json" 2>&1 | grep -v Warning | tail -14
fi
echo "== done at $(( $(date +%s) - T0 )) s"
