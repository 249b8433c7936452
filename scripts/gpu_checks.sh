#!/usr/bin/env bash
# What the GPU machine must show after graph/DDP/strategy changes.
# Usage (repository root, GPU machine): bash scripts/gpu_checks.sh OUTDIR [tests|bench|defaults|main|accelerate|all] [main_steps]
#   tests: the cuda-marked tests;  bench: benchmarks/step_time.py, every peer at the tiny, small and compute sizes;
#   defaults: the README's results table, one step_time run per model (DEFAULTS_MODELS, default "llama gpt") over
#   the three sizes: reduce-overhead, the whole-step graph, the defaults, a model the LightningModule compiled and
#   Lightning "ddp" on it (about 6 minutes a model on one H100);
#   main: the main job on the shipped gpt_small configuration (main_steps steps, default 200);
#   accelerate: examples/train_accelerate.py on 1 GPU, real graphs against the eager Accelerate run (fp32 and bf16, 2 micro-batches per step);  all: tests, bench, main.
# Results in OUTDIR: cuda_tests_all_<gpu>_<date>.log, step_time_<sizes>_<gpu>_<date>.{md,json,png},
# main_job_small_<gpu>_<date>.csv, accelerate_parity_small_<gpu>_<date>.md (the rule of benchmarks/README.md).
# Wheels for packages the GPU image lacks (omegaconf, jsonargparse and its signatures extra: docstring-parser,
# typeshed-client) may lie in .whl/ and are installed to /tmp/site.
set -uo pipefail
out=${1:-/tmp/gpu_checks}; what=${2:-all}; small_steps=${3:-200}
small_config=cg_lightning/examples/configs/gpt_small.yaml
case "$what" in tests|bench|defaults|main|accelerate|all) ;; *)
  echo "gpu_checks.sh: unknown section '$what'; use one of tests, bench, defaults, main, accelerate, all" >&2; exit 2;; esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi -L; python3 -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)'
# Result files are named <what>_<size>_<gpu>_<yyyymmdd>.<ext> and start with the run's stamp (benchmarks/README.md).
name() { python3 -m benchmarks.report name "$@"; }
stamp=$(python3 -m benchmarks.report stamp)
ngpu=$(nvidia-smi -L | wc -l)
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  log="$out/$(name cuda_tests all log --gpus "$ngpu")"
  echo "# $stamp; command: python3 -m pytest -m cuda -q -s -p no:cacheprovider tests" > "$log"
  python3 -m pytest -m cuda -q -s -p no:cacheprovider tests 2>&1 | tee -a "$log" \
    | grep -E "diff|MiB|passed|failed|Error|error|FAILED" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m benchmarks.step_time --sizes ${BENCH_SIZES:-tiny small compute} --out "$out" 2>&1 | tee "$out/bench.log" | tail -40 || status=1
fi
if [ "$what" = defaults ]; then
  for model in ${DEFAULTS_MODELS:-llama gpt}; do
    python3 -m benchmarks.step_time --model "$model" --sizes tiny small compute --repeats 3 --steps 20 --peers \
      compile_reduce_overhead whole_step_graph cudagraph_ddp cudagraph_ddp_user_compile lightning_ddp_compile \
      --tag defaults --out "$out" 2>&1 | tee "$out/defaults_$model.log" | grep -E "ms/step|error" || status=1
  done
fi
if [ "$what" = main ] || [ "$what" = all ]; then
  python3 -m cg_lightning fit --config $small_config --trainer.max_steps="$small_steps" \
    --trainer.default_root_dir="$out/runs" --trainer.enable_progress_bar=false 2>&1 | tee "$out/main_small.log" | tail -5 || status=1
  metrics=$(ls "$out"/runs/*/version_*/metrics.csv "$out"/runs/version_*/metrics.csv 2>/dev/null | head -1)
  [ -n "$metrics" ] && { echo "# $stamp; command: python3 -m cg_lightning fit --config $small_config" \
    "--trainer.max_steps=$small_steps; read with pandas.read_csv(path, comment='#')"; cat "$metrics"; } \
    > "$out/$(name main_job small csv)" && python3 - "$metrics" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r.get("train_loss")]
print("main job train_loss: first", rows[0]["train_loss"], "last", rows[-1]["train_loss"], "rows", len(rows))
PY
fi
if [ "$what" = accelerate ]; then
  A="examples/train_accelerate.py --config $small_config --max-steps ${ACC_STEPS:-30} --gradient-accumulation-steps 2"
  for mp in no bf16; do
    for mode in eager graphs; do
      flag=; [ $mode = eager ] && flag=--eager
      python3 $A --mixed-precision $mp $flag --log-every 10 --out "$out/acc_${mp}_$mode.pt" 2>&1 \
        | tee "$out/acc_${mp}_$mode.log" | tail -3 || status=1
    done
  done
  rep="$out/$(name accelerate_parity small md)"
  python3 scripts/accelerate_report.py "$rep" "$out"/acc_no_eager.pt "$out"/acc_no_graphs.pt \
    "$out"/acc_bf16_eager.pt "$out"/acc_bf16_graphs.pt || status=1
  if [ -f "$rep" ]; then
    body=$(cat "$rep")
    printf '%s\n\n%s\n' "# Accelerate, graphs against eager: $stamp; command: python3 $A" "$body" > "$rep"
  fi
fi
exit $status
