#!/usr/bin/env bash
# graphamp's GPU figures on one H100 or H200, sized to a lent session (15 minutes of device time,
# starts included; one command may run 10). The default runs the most valuable parts in order and
# stops at a deadline (BUDGET_S, default 470 s: one command of at most 8 minutes); every variant's
# row is written as soon as it is measured (bench_cuda_<part>.jsonl and .md), so a run cut short
# keeps what it measured. Results go under $OUT (default: benchmarks/results/gpu-round2).
#
#   bash benchmarks/gpu_round2.sh             # the default: mlp gpt2 blocks outline resnet50,
#                                             # cut at the deadline (≤ 8 min; round 5 reached
#                                             # resnet50 with blocks not yet in the default)
#   bash benchmarks/gpu_round2.sh gpt2_warm llama_bf16   # named parts (each fits 10 minutes)
#   BUDGET_S=900 bash benchmarks/gpu_round2.sh mlp gpt2  # another deadline
#   PACK_TO=$OUT OUT=/tmp/r bash benchmarks/gpu_round2.sh   # on the device tool, whose $OUT
#                                             # brings back at most 8 files: results packed
#                                             # into one archive (gpu_round2.tgz) and the log
#   bash benchmarks/gpu_round2.sh --smoke     # every default part at smoke size on the CPU (a
#                                             # check that the script and its commands run)
#
# Parts (every variant of a workload in one process, one after the other: same-run ratios):
#   mlp         seed MLP, 200 steps: ms/step vs eager and compiled AMP (target ≤ 0.06 ms, ≥ 20×)
#   gpt2        GPT-2 124M fp16 + bf16 vs torch.compile + autocast (+ GradScaler), cold inductor
#               cache: ms/step, TFLOP/s, MFU, peak memory, first call (cold), host syncs, profile
#   blocks      set_block_updates(True) on CUDA (off by default there): first_call.py's 6-layer
#               GPT-2, graphamp's default against graphamp-blocks and torch.compile, fresh
#               processes, cold and restart; then GPT-2 124M bf16 with block updates against
#               the inlined step (steady step and first call, one process) (~4 min)
#   outline     GPT-2 124M bf16, outlined blocks against inlined (set_outline_blocks(True) and
#               (False); CUDA's default inlines) in one process: the steady step's ratio and
#               each program's kernels per step (issue 40 §0)
#   resnet50    ResNet-50 B128, bf16 then fp16, against torch.compile + autocast (+ GradScaler)
#   -- named only --
#   gpt2_warm   the gpt2 command again on the cache gpt2 filled: warm first calls
#   fused       GPT-2 124M bf16 with AdamW(fused=True) (torch's fused kernel in the step, the
#               optimizer the compile_* peers use) against graphamp's own update and
#               torch.compile, cold inductor cache: first call and steady step
#   first_call  benchmarks/first_call.py on the GPU: the project's and transformers' 6-layer
#               GPT-2, graphamp (its default) vs torch.compile + autocast, each in a fresh
#               process, cold then a restart on the cache it filled (about 3 minutes)
#   kernels     benchmarks/kernel_count.py: structural launch counts of the step (mlp, gpt2-6l)
#   fp8         GPT-2 124M bf16, bf16 + fp8 matmuls (tensorwise, rowwise, delayed), torch.compile bf16
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
OUT=${OUT:-benchmarks/results/gpu-round2}
LOSS_STEPS=${LOSS_STEPS:-200}
BUDGET_S=${BUDGET_S:-470}
PYTHON=${PYTHON:-python3}
deadline=$((SECONDS + BUDGET_S))
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# one inductor cache for the run, outside $OUT (it is large): cold for gpt2, warm after it
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/graphamp-round2-inductor-cache}

left() { echo $((deadline - SECONDS)); }
# one command under what is left of the budget; a command cut at the deadline keeps the rows it
# wrote, and the script goes on to say so instead of failing
limited() {
  local status=0
  timeout --kill-after=10 "$(left)" "$@" 2>&1 | tee -a "$OUT/log.txt" || status=$?
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "[gpu_round2] cut at the deadline (BUDGET_S=$BUDGET_S): $*" | tee -a "$OUT/log.txt"
  elif [ "$status" -ne 0 ]; then
    echo "[gpu_round2] exit $status: $*" | tee -a "$OUT/log.txt"
  fi
}
bench() { limited "$PYTHON" benchmarks/bench.py --out "$OUT" "${SMOKE[@]}" "$@"; }
# torch 2.11's inductor asserts in its loop reordering while fusing graphamp's bf16 GPT-2 step
# on an H200 (scheduler.reorder_loops_by_dep_pair); graphamp's compile goes without it there
GRAPHAMP_INDUCTOR=()
if "$PYTHON" -c "import torch, sys; sys.exit(not torch.__version__.startswith('2.11'))"; then
  GRAPHAMP_INDUCTOR=(--inductor-option loop_ordering_after_fusion=False)
fi

part_mlp() {
  bench --workload mlp --variant graphamp_fp16 graphamp_bf16 compile_amp_fp16 compile_bf16 \
    compile_bf16_ro eager_amp_fp16 --steps 200 --warmup 20 --tag mlp
}
part_gpt2() {
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  # the strongest peers first named: fused AdamW (compile_*), the step compiled too, and
  # reduce-overhead's CUDA graphs
  bench --workload gpt2 --variant graphamp_fp16 compile_amp_fp16 graphamp_bf16 compile_bf16 \
    compile_bf16_optstep compile_bf16_ro eager_amp_fp16 --profile --tag gpt2_cold \
    "${GRAPHAMP_INDUCTOR[@]}"
}
part_fused() {
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  bench --workload gpt2 --variant graphamp_bf16_fused graphamp_bf16 compile_bf16 --tag fused \
    "${GRAPHAMP_INDUCTOR[@]}"
}
part_outline() {
  bench --workload gpt2 --variant graphamp_bf16_outline graphamp_bf16_inline --steps 100 \
    --profile --tag outline \
    "${GRAPHAMP_INDUCTOR[@]}"
}
part_blocks() {
  # first calls first (fresh processes, both sides timed from before the step is made): the
  # figures round 5 measured with the peer's import of inductor left out
  if [ ${#SMOKE[@]} -eq 0 ]; then
    local env=()
    [ ${#GRAPHAMP_INDUCTOR[@]} -gt 0 ] && env=(TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION=0)
    limited env "${env[@]}" "$PYTHON" benchmarks/first_call.py --device cuda --repeat 1 \
      --workload gpt2-6l --variant graphamp graphamp-blocks compile --out "$OUT" --tag cuda_blocks
  fi
  bench --workload gpt2 --variant graphamp_bf16_blocks graphamp_bf16_inline --steps 100 \
    --tag blocks "${GRAPHAMP_INDUCTOR[@]}"
}
part_resnet50() {
  bench --workload resnet50 --variant graphamp_bf16 compile_bf16 graphamp_fp16 compile_amp_fp16 \
    --loss-steps "$LOSS_STEPS" --tag resnet50
}
part_gpt2_warm() {
  bench --workload gpt2 --variant graphamp_fp16 compile_amp_fp16 graphamp_bf16 compile_bf16 \
    --steps 20 --tag gpt2_warm
}
part_fp8() {
  # fp8 needs compute capability 8.9 (H100/H200); torchao's float8 peer is not installed there
  bench --workload gpt2 --variant graphamp_bf16 graphamp_bf16_fp8 graphamp_bf16_fp8rw \
    graphamp_bf16_fp8dl compile_bf16 --steps 50 --tag fp8
}
part_llama_bf16() {
  bench --workload llama1b --variant graphamp_bf16 compile_bf16 --steps 20 --warmup 5 \
    --profile --tag llama_bf16
}
part_llama_fp16() {
  bench --workload llama1b --variant graphamp_fp16 compile_amp_fp16 --steps 20 --warmup 5 \
    --tag llama_fp16
}
part_first_call() {
  if [ ${#SMOKE[@]} -gt 0 ]; then
    limited "$PYTHON" benchmarks/first_call.py --smoke --repeat 1 --out "$OUT" --tag smoke
  else
    # first_call.py's child processes take no inductor option: on torch 2.11 the environment
    # turns loop reordering off (for both sides there)
    local env=()
    [ ${#GRAPHAMP_INDUCTOR[@]} -gt 0 ] && env=(TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION=0)
    limited env "${env[@]}" "$PYTHON" benchmarks/first_call.py --device cuda --repeat 1 \
      --workload gpt2-6l hf-gpt2-6l --variant graphamp compile --out "$OUT" --tag cuda
  fi
}
part_kernels() {
  # on the GPU machine the real device answers; the counts are of generated code, not a profile
  if [ ${#SMOKE[@]} -gt 0 ]; then
    limited "$PYTHON" benchmarks/kernel_count.py --smoke --workload mlp
  else
    limited "$PYTHON" benchmarks/kernel_count.py --workload mlp gpt2-6l gpt2
  fi
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(mlp gpt2 blocks outline resnet50)
"$PYTHON" -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee -a "$OUT/log.txt"
for p in "${parts[@]}"; do
  if [ "$(left)" -lt 20 ]; then
    echo "[gpu_round2] part $p skipped: $(left)s left of BUDGET_S=$BUDGET_S" | tee -a "$OUT/log.txt"
    continue
  fi
  start=$SECONDS
  "part_$p"
  echo "[gpu_round2] part $p took $((SECONDS - start))s" | tee -a "$OUT/log.txt"
done
# the device tool brings back at most 8 files; PACK_TO=DIR packs every result into one archive
if [ -n "${PACK_TO:-}" ]; then
  tar czf "$PACK_TO/gpu_round2.tgz" -C "$OUT" . && cp "$OUT/log.txt" "$PACK_TO/"
fi
