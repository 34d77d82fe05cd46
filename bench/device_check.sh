#!/usr/bin/env bash
# The GPU checks of the fused kernels in one run, for a machine with CUDA (DESIGN.md §7: ratios measured in one run).
#
#   OUT=bench/results/device bash bench/device_check.sh
#
# 1. flowalign (editable, no dependencies) into that machine's python; wheels in .whl/, if any, first (an offline
#    machine without diffusers, say).
# 2. tests/test_kernels.py with the kernels compiled for real on CUDA tensors (on CPU it needs the interpreter).
# 3. bench/kernel_speed.py: Triton against eager torch and torch.compile with bf16 latents (and fp32, without compile).
# 4. bench/mixed_precision.py: does training re-score a rollout with the stored log-probs, in fp32 and bf16?
# 5. bench/train_iteration.py: every method preset for two iterations on CUDA in bf16 (time split, peak memory).
# 6. A run with EMA on CUDA, stopped after one iteration and resumed for a second (the resumed EMA must sit on its
#    parameters' device).
# 7. bench/gpu_scale.py: a Flow-GRPO iteration on an SD3.5-Medium-sized transformer (2.24 B parameters, random
#    weights, the real VAE architecture) in bf16 at 512 px, LoRA and full fine-tuning: rollout s/image, training
#    s/transition, peak GPU memory, the rollout's TFLOP/s against the GPU's bf16 peak (at most 8 minutes).
# 8. bench/context_parallel.py: context parallel 2 (Ulysses, and ring in bf16 on cuDNN's attention) on two GPUs
#    against one, for the tiny FLUX and Wan2.1 (skipped, saying so, on a machine with one GPU). Unverified so far.
# 9. bench/memory_check.py: a LoRA step of a Wan2.1-14B-sized transformer (random weights, the shipped published
#    config) under FSDP2 with every block checkpointed, at 1280x720 and 81 frames, one sample: peak GPU memory
#    against flowalign plan's prediction (memory.json). Needs about 80 GB: on a smaller GPU it runs out of memory,
#    which the log shows. (Stage 8 is context parallel 2, for machines with two GPUs.)
# ONLY=<part of a stage name> runs just the matching stages (after the install), e.g. ONLY=GPU-scale.
# Everything goes to $OUT: all.log and the benchmarks' JSON files. Each stage has its own time limit, so one that
# fails or hangs still leaves the others' results.
set -u
OUT=${OUT:-bench/results/device}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/all.log"
: >"$LOG"

stage() {  # stage SECONDS NAME COMMAND...
  local limit=$1 name=$2 start=$SECONDS
  shift 2
  if [ -n "${ONLY:-}" ] && [[ "$name" != install* ]] && [[ "$name" != *"$ONLY"* ]]; then
    return 0
  fi
  echo "=== $name" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$LOG"
  return "$status"
}

set -o pipefail
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$LOG"
if compgen -G ".whl/*.whl" >/dev/null; then
  stage 60 "install carried wheels" "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
fi
stage 60 "install flowalign" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
'device', torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"

stage "${GPU_SCALE_LIMIT:-480}" "GPU-scale Flow-GRPO iteration, SD3.5-Medium-sized, bf16, 512 px" "$PY" \
  bench/gpu_scale.py --out "$OUT/gpu_scale.json"
stage 120 "kernel tests on CUDA" "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider -rs
stage 120 "kernel benchmark, bf16" "$PY" bench/kernel_speed.py --dtype bf16 --out "$OUT/kernels_bf16.json"
stage 200 "trainer log-probs in fp32 and bf16" "$PY" bench/mixed_precision.py --iterations 2 \
  --out "$OUT/mixed_precision.json"
stage 60 "kernel benchmark, fp32" "$PY" bench/kernel_speed.py --dtype fp32 --no-compile --profile \
  --out "$OUT/kernels_fp32.json"
stage "${PRESETS_LIMIT:-150}" "every method preset on CUDA, bf16" "$PY" bench/train_iteration.py --iterations 2 \
  --out "$OUT/train_iteration.json" model.mixed_precision=bf16
resume_run=$(mktemp -d)  # not under $OUT: checkpoints need not come back
small="data.prompts_per_iteration=2 data.group_size=4 train.eval_at_end=false train.tracker=none optim.ema_decay=0.9"
stage 180 "resume with EMA on CUDA" bash -c "$PY -m flowalign.cli train $small train.iterations=1 train.out_dir=$resume_run && \
  $PY -m flowalign.cli train $small train.iterations=2 train.resume=latest train.out_dir=$resume_run && \
  ls $resume_run/checkpoint-000002/ema.safetensors"
stage 300 "context parallel 2 on two GPUs" "$PY" bench/context_parallel.py --out "$OUT/context_parallel.json"
stage "${MEMORY_LIMIT:-300}" "memory plan against FSDP2 + activation checkpointing, Wan2.1-14B-sized, 720p 81 frames" \
  "$PY" bench/memory_check.py --out "$OUT/memory.json"
