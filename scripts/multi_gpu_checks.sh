#!/usr/bin/env bash
# Two-GPU (NCCL) parity, failure and scaling checks, on the nvidia-h200-x2 machine, repo root:
#   bash scripts/multi_gpu_checks.sh WORKDIR [REPORTDIR] [sections...]
# sections (default: all, in this order): small models engine scaling accelerate
#   repeat      the 2-GPU parity test's GPT (12 layers, d=256, T=128, fp32, 50 steps): each strategy twice, our
#               engine without graphs, graphs with CUDA_LAUNCH_BLOCKING=1 (no stream overlap) and both with
#               deterministic kernels: tells kernel noise, stream races and engine errors apart
#   bf16diag    small GPT, bf16-mixed, 50 steps, fused kernels: why cudagraph_ddp can leave "ddp" by ~1e-2 here
#               while it equals it bit for bit with deterministic kernels: pairs with a fixed cuBLAS
#               workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8), with math, flash or cuDNN attention only (cu13
#               builds enable cuDNN attention by default, and it has known CUDA-graph capture restrictions)
#   bf16noise   small GPT, bf16-mixed, 50 steps, flash attention: two runs of each strategy (run-to-run spread of
#               the atomic dq accumulation) and a math-attention "ddp" run as reference
#   small       small GPT (d=768, T=512), $SMALL_STEPS steps (default 20): both strategies with deterministic kernels, Lightning "ddp"
#               against itself (tells kernel noise from engine error), bf16-mixed pair, fp32 pair
#   models      tied weights + accumulation (loss recomputed), checkpoint-hidden-parameter seed model
#   engine      engine_dist.py scenarios overlap, stuck, missing (NCCL, engine timeout 10 s)
#   scaling     benchmarks/scaling.py, sizes $SCALING_SIZES (default tiny small), strategies $SCALING_STRATEGIES
#               (default ddp cudagraph_ddp), 1 and 2 GPUs
#   accelerate  examples/train_accelerate.py on 1 GPU, fp32, graphs against eager, per-tensor report
# SKIP_DDP_REPEAT=1 leaves out the "ddp" repeat run of the small section.
# Runs and logs go to WORKDIR; REPORTDIR (default WORKDIR) gets multi_gpu_checks_all_<gpu>x2_<date>.md and
# scaling_<sizes>_<gpu>x2_<date>.jsonl only (the naming rule of benchmarks/README.md), written as each section ends. BUDGET_S (default 540) bounds the whole script: a run that would pass it is skipped.
# Leaves NCCL_NVLS_ENABLE and the other machine settings as they are.
set -uo pipefail
work=${1:-/tmp/mgpu}; rep=${2:-$work}; shift 2 2>/dev/null || shift $#
sections=${*:-small models engine scaling accelerate}
mkdir -p "$work" "$rep"
deadline=$(( $(date +%s) + ${BUDGET_S:-540} ))
left() { echo $(( deadline - $(date +%s) )); }
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
name() { python3 -m benchmarks.report name "$@"; }
report=$rep/$(name multi_gpu_checks all md --gpus 2)
scaling_sizes=${SCALING_SIZES:-tiny small}
scaling=$rep/$(name scaling "${scaling_sizes// /-}" jsonl --gpus 2)
echo "# $(python3 -m benchmarks.report stamp); command: bash scripts/multi_gpu_checks.sh WORKDIR REPORTDIR $sections" | tee -a "$report"
python3 -c 'import torch; print("GPUs", torch.cuda.device_count(), torch.cuda.get_device_name(), torch.__version__)' \
  | tee -a "$report"
P=tests/scripts/train_parity.py
run() { # name strategy args...: one train_parity.py run on 2 GPUs, bounded by the deadline
  local name=$1 strat=$2; shift 2
  local lim=$(( $(left) - 5 )); [ $lim -gt 240 ] && lim=240
  if [ $lim -lt 30 ]; then echo "SKIPPED $name $strat (budget)" | tee -a "$report"; return; fi
  local s=$(date +%s)
  timeout $lim python3 $P --accelerator gpu --devices 2 --backend cuda --strategy "$strat" --out "$work/$name.$strat.pt" \
    "$@" > "$work/$name.$strat.log" 2>&1 || { echo "FAILED $name $strat"; tail -5 "$work/$name.$strat.log"; } | tee -a "$report"
  echo "  $name $strat: $(( $(date +%s) - s )) s"
}
pairs() { echo; python3 scripts/parity_report.py "$work/pairs.md" "$@" | tee -a "$report"; }
SMALL="--n-layer 12 --d-model 768 --n-head 12 --block-size 512 --batch-size 8"
for sec in $sections; do
  echo "== $sec ($(left) s left)"
  case $sec in
  repeat)
    R="--n-layer 12 --d-model 256 --n-head 4 --block-size 128 --batch-size 8 --steps 50"
    run rep_a ddp $R
    run rep_a cudagraph_ddp $R
    run rep_b ddp $R
    run rep_b cudagraph_ddp $R
    run rep_nographs cudagraph_ddp $R --no-graphs
    CUDA_LAUNCH_BLOCKING=1 run rep_blocking cudagraph_ddp $R
    run rep_det ddp $R --deterministic
    run rep_det cudagraph_ddp $R --deterministic
    pairs "repeat: ddp vs ddp=$work/rep_a.ddp.pt,$work/rep_b.ddp.pt" \
      "repeat: cg vs cg=$work/rep_a.cudagraph_ddp.pt,$work/rep_b.cudagraph_ddp.pt" \
      "repeat: cg vs ddp (a)=$work/rep_a.ddp.pt,$work/rep_a.cudagraph_ddp.pt" \
      "repeat: cg vs ddp (b)=$work/rep_b.ddp.pt,$work/rep_b.cudagraph_ddp.pt" \
      "repeat: engine without graphs vs ddp=$work/rep_a.ddp.pt,$work/rep_nographs.cudagraph_ddp.pt" \
      "repeat: cg with CUDA_LAUNCH_BLOCKING set vs ddp=$work/rep_a.ddp.pt,$work/rep_blocking.cudagraph_ddp.pt" \
      "repeat: deterministic kernels=$work/rep_det.ddp.pt,$work/rep_det.cudagraph_ddp.pt" ;;
  bf16diag)
    B="$SMALL --steps 50 --precision bf16-mixed"
    CUBLAS_WORKSPACE_CONFIG=:4096:8 run diag_ws ddp $B
    CUBLAS_WORKSPACE_CONFIG=:4096:8 run diag_ws cudagraph_ddp $B
    run diag_math ddp $B --sdpa math
    run diag_math cudagraph_ddp $B --sdpa math
    run diag_flash ddp $B --sdpa flash
    run diag_flash cudagraph_ddp $B --sdpa flash
    run diag_cudnn ddp $B --sdpa cudnn
    run diag_cudnn cudagraph_ddp $B --sdpa cudnn
    pairs "bf16 fixed cuBLAS workspace=$work/diag_ws.ddp.pt,$work/diag_ws.cudagraph_ddp.pt" \
      "bf16 math attention=$work/diag_math.ddp.pt,$work/diag_math.cudagraph_ddp.pt" \
      "bf16 flash attention=$work/diag_flash.ddp.pt,$work/diag_flash.cudagraph_ddp.pt" \
      "bf16 cuDNN attention=$work/diag_cudnn.ddp.pt,$work/diag_cudnn.cudagraph_ddp.pt" ;;
  bf16noise)
    # is cudagraph_ddp farther from "ddp" than "ddp" is from itself, with flash attention (atomic dq)? Both are
    # also measured against a run with math attention (no atomics), the closest thing to a reference.
    B="$SMALL --steps 50 --precision bf16-mixed"
    run noise_a ddp $B --sdpa flash
    run noise_b ddp $B --sdpa flash
    run noise_a cudagraph_ddp $B --sdpa flash
    run noise_b cudagraph_ddp $B --sdpa flash
    run noise_math ddp $B --sdpa math
    pairs "flash: ddp vs ddp=$work/noise_a.ddp.pt,$work/noise_b.ddp.pt" \
      "flash: cg vs cg=$work/noise_a.cudagraph_ddp.pt,$work/noise_b.cudagraph_ddp.pt" \
      "flash: cg a vs ddp a=$work/noise_a.ddp.pt,$work/noise_a.cudagraph_ddp.pt" \
      "flash: cg b vs ddp b=$work/noise_b.ddp.pt,$work/noise_b.cudagraph_ddp.pt" \
      "flash ddp a vs math ddp=$work/noise_math.ddp.pt,$work/noise_a.ddp.pt" \
      "flash ddp b vs math ddp=$work/noise_math.ddp.pt,$work/noise_b.ddp.pt" \
      "flash cg a vs math ddp=$work/noise_math.ddp.pt,$work/noise_a.cudagraph_ddp.pt" \
      "flash cg b vs math ddp=$work/noise_math.ddp.pt,$work/noise_b.cudagraph_ddp.pt" ;;
  small)
    S=${SMALL_STEPS:-20}
    run small_32_det ddp $SMALL --steps $S --deterministic
    run small_32_det cudagraph_ddp $SMALL --steps $S --deterministic
    run small_bf16 ddp $SMALL --steps $S --precision bf16-mixed
    run small_bf16 cudagraph_ddp $SMALL --steps $S --precision bf16-mixed
    run small_32 ddp $SMALL --steps $S
    run small_32 cudagraph_ddp $SMALL --steps $S
    [ -z "${SKIP_DDP_REPEAT:-}" ] && run small_32_repeat ddp $SMALL --steps $S
    pairs "small fp32, deterministic kernels=$work/small_32_det.ddp.pt,$work/small_32_det.cudagraph_ddp.pt" \
      "small fp32, ddp vs ddp (same seed)=$work/small_32.ddp.pt,$work/small_32_repeat.ddp.pt" \
      "small fp32=$work/small_32.ddp.pt,$work/small_32.cudagraph_ddp.pt" \
      "small bf16-mixed=$work/small_bf16.ddp.pt,$work/small_bf16.cudagraph_ddp.pt" ;;
  models)
    T="--n-layer 4 --d-model 128 --n-head 4 --block-size 64 --batch-size 8 --tie-weights --no-bias --accumulate 4 --steps 12"
    run tied_accum4 ddp $T
    run tied_accum4 cudagraph_ddp $T --recompute-loss
    run seed_hidden ddp --model seed --steps 10 --warmup-steps 1
    run seed_hidden cudagraph_ddp --model seed --steps 10 --warmup-steps 1
    pairs "tied+accumulate 4 (cg: loss recomputed)=$work/tied_accum4.ddp.pt,$work/tied_accum4.cudagraph_ddp.pt" \
      "checkpoint-hidden parameter (seed model)=$work/seed_hidden.ddp.pt,$work/seed_hidden.cudagraph_ddp.pt" ;;
  engine)
    for sc in overlap stuck missing; do
      [ "$(left)" -lt 60 ] && { echo "SKIPPED engine $sc (budget)" | tee -a "$report"; continue; }
      mkdir -p "$work/engine_$sc"; s=$(date +%s)
      timeout 90 python3 -m torch.distributed.run --nproc_per_node 2 tests/scripts/engine_dist.py --device cuda \
        --scenario $sc --out "$work/engine_$sc" > "$work/engine_$sc.log" 2>&1
      echo "engine scenario $sc: exit $? after $(( $(date +%s) - s )) s" | tee -a "$report"
      python3 - "$work/engine_$sc" <<'PY' | tee -a "$report"
import json, os, sys
for r in (0, 1):
    p = os.path.join(sys.argv[1], f"rank{r}.json")
    if not os.path.exists(p):
        print(f"  rank {r}: no result"); continue
    d = json.load(open(p))
    ev = d.get("events") or []
    first_dispatch = next((i for i, e in enumerate(ev) if e[0] == "dispatch"), None)
    first_layer0 = next((i for i, e in enumerate(ev) if e[0] == "ready" and e[1].startswith("layers.0.")), None)
    print(f"  rank {r}: buckets {d.get('buckets')}, dispatch order {d.get('dispatch_order')}, first dispatch at event "
          f"{first_dispatch}, first layers.0 ready at {first_layer0}, stuck {d.get('stuck')}, "
          f"error after {d.get('error_after_s')} s: {(d.get('error') or '')[:160]!r}")
PY
    done ;;
  scaling)
    for size in $scaling_sizes; do
      for strat in ${SCALING_STRATEGIES:-ddp cudagraph_ddp}; do
        for n in 1 2; do
          [ "$(left)" -lt 60 ] && { echo "SKIPPED scaling $size $strat $n (budget)" | tee -a "$report"; continue; }
          timeout 120 python3 benchmarks/scaling.py --size $size --strategy $strat --devices $n --steps 20 --repeats 3 \
            --out "$scaling" > "$work/scaling_${size}_${strat}_$n.log" 2>&1 \
            || { echo "FAILED scaling $size $strat $n"; tail -3 "$work/scaling_${size}_${strat}_$n.log"; } | tee -a "$report"
        done
      done
    done
    [ -f "$scaling" ] && python3 benchmarks/scaling.py --report "$scaling" | tee -a "$report" ;;
  accelerate)
    A="examples/train_accelerate.py --config cg_lightning/examples/configs/gpt_small.yaml --max-steps 20"
    A="$A --gradient-accumulation-steps 2"
    for mode in eager graphs; do
      [ "$(left)" -lt 45 ] && { echo "SKIPPED accelerate $mode (budget)" | tee -a "$report"; continue; }
      flag=; [ $mode = eager ] && flag=--eager
      CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 5 )) python3 $A --mixed-precision no $flag --log-every 10 \
        --out "$work/acc_$mode.pt" > "$work/acc_$mode.log" 2>&1 || echo "FAILED accelerate $mode" | tee -a "$report"
    done
    python3 scripts/accelerate_report.py "$work/acc.md" "$work/acc_eager.pt" "$work/acc_graphs.pt" | tee -a "$report" ;;
  esac
done
echo "done, $(left) s of the budget left"
