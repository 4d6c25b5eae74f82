#!/usr/bin/env bash
# Every single-GPU check of this folder in one go, each under its own time limit, each logged to <name>.log in $OUT/logs.tar.gz,
# with a summary line per check in its summary.txt. For a lent device machine (one GPU, no package registry):
# the wheels it lacks travel in .whl/ (miles' own packages included, for their entry points; the sources of this
# tree come first on PYTHONPATH), the tool model's cache in .gpucache/.
#   bash scripts/gpu/run_all.sh [check ...]        # default: every check below, in this order
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/miles-gpu-out}
LOGS=/tmp/miles-gpu-logs  # bundled into $OUT/logs.tar.gz after every check (a device run returns few files)
DEADLINE=${MILES_GPU_DEADLINE:-420}  # seconds from now: later checks are cut to what is left, or skipped
T0=$(date +%s)
mkdir -p "$OUT" "$LOGS"
if [ -d .whl ] && [ -z "${MILES_GPU_NO_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$LOGS/install.log" 2>&1 || { tail -20 "$LOGS/install.log"; exit 1; }
  src=$(printf '%s:' "$PWD"/miles-*/src)
  export PYTHONPATH="$src/tmp/site:$PWD"
fi
[ -d .gpucache/tool-models ] && mkdir -p ~/.cache/miles && cp -rn .gpucache/tool-models ~/.cache/miles/
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/summary.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$LOGS/summary.txt"

run() {  # name, seconds, command...
  local name=$1 limit=$2 start rc left
  shift 2
  start=$(date +%s)
  left=$(( DEADLINE - (start - T0) ))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped (deadline)" | tee -a "$LOGS/summary.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  grep -vE "Loading weights|Writing model shards|it/s\]|^W1|^  warnings.warn" "$LOGS/$name.log" | tail -25
  echo "$name: rc=$rc $(( $(date +%s) - start ))s" | tee -a "$LOGS/summary.txt"
  tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
}

checks=("$@")
[ ${#checks[@]} -eq 0 ] && checks=(train attention precision lora trainer trainer-fused fidelity transports sessions diffusion megatron)
for check in "${checks[@]}"; do
  case $check in
    train) run train 300 python3 scripts/gpu/train_check.py --device cuda --model qwen0.5b --steps 5 --out "$LOGS" ;;
    attention) run attention 60 python3 scripts/gpu/attention_check.py ;;
    precision) run precision 120 python3 scripts/gpu/precision_check.py ;;
    lora) run lora 90 python3 scripts/gpu/lora_check.py ${MILES_GPU_CHECK_DEVICE:-cuda} ;;
    trainer) run trainer 200 python3 -m benchmarks.trainer --device cuda --precision bf16 --models qwen0.5b \
      --backends fsdp --seqs 16 --prompt-len 256 --response-len 768 --micro-batch-tokens 8192 --steps 3 --warmup 1 \
      --rounds 1 --threads 8 --results-dir "$LOGS" ;;
    trainer-fused) run trainer-fused 150 python3 -m benchmarks.trainer --device cuda --precision bf16 --models qwen0.5b \
      --backends fsdp --seqs 16 --prompt-len 256 --response-len 768 --micro-batch-tokens 8192 --steps 3 --warmup 1 \
      --rounds 1 --threads 8 --fsdp-set fused_logprobs=true --fsdp-set wrap_single_rank=false --results-dir "$LOGS/fused" ;;
    transports) run transports 120 python3 scripts/gpu/check_weight_transports.py ;;
    fidelity) run fidelity 120 python3 scripts/gpu/fidelity_check.py ;;
    diffusion) run diffusion 90 python3 scripts/gpu/diffusion_check.py ;;
    sessions) run sessions 150 python3 scripts/gpu/sessions_check.py ;;
    megatron) run megatron 150 python3 -m benchmarks.trainer --device cuda --precision bf16 --models tiny,moe \
      --backends fsdp,megatron --steps 2 --warmup 1 --rounds 1 --threads 4 --results-dir "$LOGS/megatron" ;;
    *) echo "unknown check $check"; exit 2 ;;
  esac
done
cat "$LOGS/summary.txt"
