#!/usr/bin/env bash
# Issue 15's GPU figures on one H100, in parts that each fit a 10-minute command (about 25 minutes
# of device time in all). Results go under $OUT (default: benchmarks/results/h100-round2).
#
#   bash benchmarks/gpu_round2.sh             # every part, in order
#   bash benchmarks/gpu_round2.sh mlp gpt2    # some parts (one device command each, ≤ 10 min)
#   bash benchmarks/gpu_round2.sh --smoke     # every part at smoke size on the CPU (a check
#                                             # that the script and its commands run; no figures)
#
# Parts (every variant of a workload in one process, one after the other: same-run ratios):
#   mlp         seed MLP, 200 steps: ms/step vs eager AMP (target ≤ 0.06 ms, ≥ 20×), profile
#   gpt2        GPT-2 124M fp16 + bf16 vs compile+autocast(+GradScaler), cold inductor cache:
#               ms/step, TFLOP/s, MFU, peak memory, first call (cold), host syncs, profile
#   gpt2_warm   the same command again on the cache gpt2 filled: warm first calls
#   resnet50    ResNet-50 B128 vs its peers (the same-run figure issue 15 asks for), 200 steps
#   first_call  benchmarks/first_call.py on the GPU: GPT-2 6-layer and ViT-tiny, graphamp vs
#               torch.compile + autocast, each in a fresh process, cold then warm inductor cache
#   kernels     benchmarks/kernel_count.py: structural launch counts of the step (mlp, gpt2-6l)
#   llama_bf16  1.1B Llama-style decoder bf16 vs compile_bf16 (tokens/s, MFU, memory, first call)
#   llama_fp16  the same, fp16 + GradScaler vs compile+autocast+GradScaler
# Kernels per step: the "profile" field of graphamp's rows (--profile: kernels_per_step and the top
# kernels of 5 steady steps), to set beside the structural counts of benchmarks/kernel_count.py.
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=()
if [ "${1:-}" = "--smoke" ]; then
  shift
  SMOKE=(--smoke)
  LOSS_STEPS=5
  OUT=${OUT:-/tmp/graphamp-round2-smoke}
fi
OUT=${OUT:-benchmarks/results/h100-round2}
LOSS_STEPS=${LOSS_STEPS:-200}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# one inductor cache for the run, outside $OUT (it is large): cold for gpt2, warm for gpt2_warm
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/graphamp-round2-inductor-cache}
bench() { python benchmarks/bench.py --out "$OUT" "${SMOKE[@]}" "$@" 2>&1 | tee -a "$OUT/log.txt"; }

part_mlp() {
  bench --workload mlp --steps 200 --warmup 20 --profile --tag mlp
}
part_gpt2() {
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  bench --workload gpt2 --variant graphamp_fp16 compile_amp_fp16 eager_amp_fp16 graphamp_bf16 \
    compile_bf16 --profile --tag gpt2_cold
}
part_gpt2_warm() {
  bench --workload gpt2 --variant graphamp_fp16 compile_amp_fp16 graphamp_bf16 compile_bf16 \
    --steps 20 --tag gpt2_warm
}
part_resnet50() {
  bench --workload resnet50 --variant graphamp_fp16 compile_amp_fp16 eager_amp_fp16 \
    graphamp_bf16 compile_bf16 --loss-steps "$LOSS_STEPS" --profile --tag resnet50
}
part_llama_bf16() {
  bench --workload llama1b --variant graphamp_bf16 compile_bf16 --steps 20 --warmup 5 \
    --profile --tag llama_bf16
}
part_first_call() {
  if [ ${#SMOKE[@]} -gt 0 ]; then
    python benchmarks/first_call.py --smoke --repeat 1 --out "$OUT" --tag smoke 2>&1 | tee -a "$OUT/log.txt"
  else
    python benchmarks/first_call.py --device cuda --repeat 1 --out "$OUT" --tag cuda 2>&1 | tee -a "$OUT/log.txt"
  fi
}
part_kernels() {
  # on the GPU machine the real device answers; the counts are of generated code, not a profile
  if [ ${#SMOKE[@]} -gt 0 ]; then
    python benchmarks/kernel_count.py --smoke --workload mlp 2>&1 | tee -a "$OUT/kernels.jsonl"
  else
    python benchmarks/kernel_count.py --workload mlp gpt2-6l gpt2 2>&1 | tee -a "$OUT/kernels.jsonl"
  fi
}
part_llama_fp16() {
  bench --workload llama1b --variant graphamp_fp16 compile_amp_fp16 --steps 20 --warmup 5 \
    --tag llama_fp16
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(mlp gpt2 gpt2_warm resnet50 llama_bf16 llama_fp16 first_call kernels)
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee -a "$OUT/log.txt"
for p in "${parts[@]}"; do
  start=$(date +%s)
  "part_$p"
  echo "[gpu_round2] part $p took $(( $(date +%s) - start ))s" | tee -a "$OUT/log.txt"
done
