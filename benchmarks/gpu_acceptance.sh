#!/usr/bin/env bash
# GPU acceptance in one command, on a bare H100/H200 machine with its own torch (2.11):
#
#   benchmarks/gpu_acceptance.sh OUT_DIR [--part 1|2]   # run part 1, part 2 or (no --part) both
#   benchmarks/gpu_acceptance.sh OUT_DIR --dry-run       # CPU: check every step's command
#
# A lease has 15 minutes of device time and 10 minutes a command: the steps come in two
# parts, one device command each (part 1's step limits sum to 510 s, part 2's to 315 s;
# on 2026-11-30 they took 330 s and 208 s; optim then made its gradients on the CPU and ran
# out of time, 56 s since; step_profile is new since), run back to back on the same warm
# machine.
# Steps, each under its own time limit:
#   part 1 (the acceptance targets and correctness)
#     linear_compiled  bench_linear.py: bf16 vs float8kit ($RECIPES) vs torchao, compiled
#                      fwd+bwd, back to back and synchronized after every step, at the seed
#                      shape and the three Llama-3-8B shapes ($SHAPES; M x K x N)
#     roofline         roofline.py: the prediction per shape from this GPU's measured gemm
#                      rates and bandwidth, beside linear_compiled's measured speedups
#     gpu_tests        pytest -m gpu (the cuBLAS float8 kernels against emulation, fp32 and
#                      torchao; compiled bitwise eager; the one-pass cast kernel)
#     train            bench_train.py: the e2e training step (llama3-8b-4l, compiled), tokens/s
#                      and peak memory, bf16 vs float8kit vs torchao, the two recipes with
#                      targets (tensorwise, delayed; four compiles, 127 s on a cold cache; the
#                      JSON is written after every variant, so a stopped run keeps them)
#   part 2
#     linear_more      rowwise_with_gw_hp and blockwise, compiled, at the seed shape
#     memory           tests/test_memory.py: activation bytes kept for backward per token
#     precompute       bench_precompute.py: precompute_scales' host time per step for 1, 8,
#                      32 delayed layers, and whether it waits for a busy GPU
#     optim            bench_optim.py: AdamW8bit / AdamW4bit's step (float8kit, torchao) on
#                      Llama-3-8B weight shapes: time over fp32 AdamW, bytes, update SQNR
#     step_profile     bench_step_profile.py: one compiled step at 8192x4096x4096 under
#                      torch.profiler, float8kit vs torchao (tensorwise; delayed float8kit
#                      only): GPU busy and idle time, host time to the first kernel and gemm
#     train_rowwise    bench_train.py for rowwise (bf16, float8kit, torchao)
# Writes into OUT_DIR: one JSON (+ .md) per benchmark, a log per step, steps.json (each
# step's command, exit status, seconds) and summary.md (the card, driver, torch, the step
# table and every table the benchmarks wrote). Exits non-zero when a step failed.
#
# torchao and expecttest may be missing on the GPU machine, with no package index there:
# download their wheels into .whl/ beforehand (docs/gpu.md shows the pip download command);
# this script installs them into /tmp/site when .whl/ exists.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [--dry-run]" >&2
    exit 2
fi
OUT=$1
shift
DRY=0
PART=all
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY=1 ;;
        --part) PART=$2; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-python3}
mkdir -p "$OUT"

if [ -d .whl ] && [ $DRY -eq 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# The recipes an H100/H200 (sm90) runs; mxfp8's kernels need sm100 (B200): add it there.
RECIPES=${RECIPES:-tensorwise,rowwise,delayed,static}
# the seed shape and Llama-3-8B's w1|w3 ... at 8192 tokens (M x K x N)
SHAPES=${SHAPES:-4096x8192x16384,8192x4096x4096,8192x4096x14336,8192x14336x4096}
TIMING="--timing back_to_back,synced"

# part | name | time limit (s) | command
STEPS=(
    "1|linear_compiled|150|$PY benchmarks/bench_linear.py --shapes $SHAPES --recipes $RECIPES --modes fwd_bwd $TIMING --compile --no-eager --no-plot --out $OUT/linear_compiled.json"
    "1|roofline|20|$PY benchmarks/roofline.py --shapes $SHAPES --modes fwd_bwd --device cuda --linear-json $OUT/linear_compiled.json --recipe tensorwise --out $OUT/roofline.json"
    "1|gpu_tests|180|$PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider"
    "1|train|160|$PY benchmarks/bench_train.py --preset llama3-8b-4l --compile --recipes tensorwise,delayed --out $OUT/train.json"
    "2|linear_more|35|$PY benchmarks/bench_linear.py --shapes 4096x8192x16384 --recipes rowwise_with_gw_hp,blockwise --modes fwd_bwd $TIMING --compile --no-eager --no-plot --out $OUT/linear_more.json"
    "2|memory|20|$PY -m pytest -q tests/test_memory.py -p no:cacheprovider"
    "2|precompute|25|$PY benchmarks/bench_precompute.py --layers 1,8,32 --out $OUT/precompute.json"
    "2|optim|75|$PY benchmarks/bench_optim.py --device cuda --out $OUT/optim.json"
    "2|step_profile|60|$PY benchmarks/bench_step_profile.py --shape 8192x4096x4096 --recipes tensorwise,delayed --out $OUT/step_profile.json"
    "2|train_rowwise|100|$PY benchmarks/bench_train.py --preset llama3-8b-4l --compile --recipes rowwise --out $OUT/train_rowwise.json"
)

# --dry-run: every step's script exists, imports and accepts its flags (argparse --help
# lists each flag used); pytest steps name test paths that exist and declared markers.
check_step() {
    local cmd=$1
    read -r -a words <<<"$cmd"
    if [ "${words[1]}" = "-m" ] && [ "${words[2]}" = "pytest" ]; then
        "$PY" -c "import pytest" || { echo "pytest missing"; return 1; }
        local prev=""
        for w in "${words[@]:3}"; do
            if [ "$prev" = "-m" ]; then
                grep -q "\"$w:" pyproject.toml || { echo "marker $w not declared"; return 1; }
            elif [[ $w != -* ]] && [ "$prev" != "-p" ] && [ ! -e "$w" ]; then
                echo "missing test path: $w"
                return 1
            fi
            prev=$w
        done
        return 0
    fi
    local script=${words[1]}
    [ -f "$script" ] || { echo "missing script: $script"; return 1; }
    local help
    help=$("$PY" "$script" --help) || { echo "$script --help failed"; return 1; }
    for w in "${words[@]:2}"; do
        if [[ $w == --* ]] && ! grep -q -- "${w%%=*}" <<<"$help"; then
            echo "$script has no flag $w"
            return 1
        fi
    done
}

failed=0
json="["
table="| step | exit | seconds | command |\n|---|---|---|---|\n"
start_all=$(date +%s)
for step in "${STEPS[@]}"; do
    IFS='|' read -r part name limit cmd <<<"$step"
    [ "$PART" != all ] && [ "$PART" != "$part" ] && continue
    t0=$(date +%s)
    if [ $DRY -eq 1 ]; then
        check_step "$cmd" >"$OUT/$name.log" 2>&1
        rc=$?
    else
        echo "== $name: $cmd" >&2
        timeout "$limit" $cmd >"$OUT/$name.log" 2>&1
        rc=$?
    fi
    secs=$(($(date +%s) - t0))
    [ $rc -ne 0 ] && failed=1 && echo "step $name failed (exit $rc): see $OUT/$name.log" >&2
    json+="{\"step\": \"$name\", \"part\": $part, \"exit\": $rc, \"seconds\": $secs, \"limit_s\": $limit, \"command\": \"$cmd\"},"
    table+="| $name | $rc | $secs | \`$cmd\` |\n"
done
json="${json%,}]"
echo "$json" >"$OUT/steps.json"

{
    echo "# float8kit GPU acceptance, part $PART$([ $DRY -eq 1 ] && echo ' (dry run: commands checked, nothing run)')"
    echo
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null \
        | sed 's/^/- card (name, driver, memory, max SM clock): /' || true
    "$PY" -c "import torch, sys, datetime
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'
print(f'- device: {dev}')
print(f'- torch {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}')
print(f'- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}')"
    echo "- commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
    echo "- total: $(($(date +%s) - start_all)) s"
    echo
    printf "%b" "$table"
    for md in "$OUT"/*.md; do
        [ "$md" = "$OUT/summary.md" ] || [ ! -f "$md" ] && continue
        echo
        echo "## $(basename "$md" .md)"
        echo
        cat "$md"
    done
} >"$OUT/summary.md"
cat "$OUT/summary.md"
exit $failed
