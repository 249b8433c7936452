#!/usr/bin/env bash
# Two-GPU (NCCL) parity and failure checks for issue 9; run on the nvidia-h200-x2 machine from the repo root:
#   bash scripts/multi_gpu_checks.sh OUTDIR
# Leaves NCCL_NVLS_ENABLE and the other machine settings as they are.
set -uo pipefail
out=${1:-/tmp/mgpu}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c 'import torch; print("GPUs", torch.cuda.device_count(), torch.__version__)'
P=tests/scripts/train_parity.py
run() { # name strategy args...
  local name=$1 strat=$2; shift 2
  timeout 300 python3 $P --accelerator gpu --devices 2 --backend cuda --strategy "$strat" --out "$out/$name.$strat.pt" "$@" \
    > "$out/$name.$strat.log" 2>&1 || { echo "FAILED $name $strat"; tail -5 "$out/$name.$strat.log"; }
}
TINY="--n-layer 12 --d-model 256 --n-head 4 --block-size 128 --batch-size 8"
SMALL="--n-layer 12 --d-model 768 --n-head 12 --block-size 512 --batch-size 8"
pairs=()
for size in tiny small; do
  [ $size = tiny ] && M=$TINY || M=$SMALL
  for prec in 32-true bf16-mixed; do
    run "${size}_${prec}" ddp $M --precision $prec --steps 50
    run "${size}_${prec}" cudagraph_ddp $M --precision $prec --steps 50
    pairs+=("${size}_${prec}=$out/${size}_${prec}.ddp.pt,$out/${size}_${prec}.cudagraph_ddp.pt")
  done
done
T="--n-layer 4 --d-model 128 --n-head 4 --block-size 64 --batch-size 8 --tie-weights --no-bias --accumulate 4 --steps 12"
run tied_accum4 ddp $T
run tied_accum4 cudagraph_ddp $T --recompute-loss
pairs+=("tied_accum4(cg:recompute-loss)=$out/tied_accum4.ddp.pt,$out/tied_accum4.cudagraph_ddp.pt")
run seed_hidden ddp --model seed --steps 10 --warmup-steps 1
run seed_hidden cudagraph_ddp --model seed --steps 10 --warmup-steps 1
pairs+=("checkpoint_hidden_param=$out/seed_hidden.ddp.pt,$out/seed_hidden.cudagraph_ddp.pt")
# Kernel noise or engine error? Lightning "ddp" against itself, and both strategies with deterministic kernels.
M=$SMALL
run small_32-true_repeat ddp $M --precision 32-true --steps 50
pairs+=("small_32-true(ddp_vs_ddp)=$out/small_32-true.ddp.pt,$out/small_32-true_repeat.ddp.pt")
run small_32-true_det ddp $M --precision 32-true --steps 50 --deterministic
run small_32-true_det cudagraph_ddp $M --precision 32-true --steps 50 --deterministic
pairs+=("small_32-true(deterministic)=$out/small_32-true_det.ddp.pt,$out/small_32-true_det.cudagraph_ddp.pt")
python3 scripts/parity_report.py "$out/parity_2gpu.md" "${pairs[@]}"
for sc in overlap stuck missing; do
  mkdir -p "$out/engine_$sc"
  start=$(date +%s)
  timeout 120 python3 -m torch.distributed.run --nproc_per_node 2 tests/scripts/engine_dist.py --device cuda \
    --scenario $sc --out "$out/engine_$sc" > "$out/engine_$sc.log" 2>&1
  echo "engine scenario $sc: exit $? after $(( $(date +%s) - start )) s"
  python3 - "$out/engine_$sc" <<'PY'
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
done
