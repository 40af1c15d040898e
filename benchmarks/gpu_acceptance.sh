#!/usr/bin/env bash
# GPU acceptance in one command, on a bare H100/H200 machine with its own torch (2.11):
#
#   benchmarks/gpu_acceptance.sh OUT_DIR            # run everything (< 9 minutes: the step limits sum to 530 s)
#   benchmarks/gpu_acceptance.sh OUT_DIR --dry-run  # CPU: check every step's command
#
# Steps (each under its own time limit, so the whole run fits one 10-minute command):
#   gpu_tests  pytest -m gpu (the cuBLAS float8 kernels against emulation, fp32 and torchao)
#   linear     bench_linear.py: bf16 vs float8kit ($RECIPES) vs torchao, fwd+bwd, eager,
#              on the four reference shapes (1024x2048x1024 ... 16384^3; M x K x N)
#   linear_compiled  the same, compiled, at the seed shape 4096x8192x16384
#   train      bench_train.py: the e2e training step (llama3-8b-4l, compiled), tokens/s and
#              peak memory, bf16 vs float8kit vs torchao
#   memory     tests/test_memory.py: activation bytes kept for backward per token vs bf16
# Writes into OUT_DIR: one JSON (+ .md) per benchmark, a log per step, steps.json (each
# step's command, exit status, seconds) and summary.md (the device, torch, the step table
# and every table the benchmarks wrote). Exits non-zero when a step failed.
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
DRY=0
[ "${2:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
mkdir -p "$OUT"

if [ -d .whl ] && [ $DRY -eq 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# The recipes an H100/H200 (sm90) runs; mxfp8's kernels need sm100 (B200): add it there.
RECIPES=${RECIPES:-tensorwise,rowwise,rowwise_with_gw_hp,delayed,blockwise}

# name | time limit (s) | command
STEPS=(
    "gpu_tests|120|$PY -m pytest -q -m gpu tests -p no:cacheprovider"
    "linear|90|$PY benchmarks/bench_linear.py --shapes square --recipes $RECIPES --modes fwd_bwd --no-compile --no-plot --out $OUT/linear.json"
    "linear_compiled|90|$PY benchmarks/bench_linear.py --shapes 4096x8192x16384 --recipes $RECIPES --modes fwd_bwd --compile --no-eager --no-plot --out $OUT/linear_compiled.json"
    "train|200|$PY benchmarks/bench_train.py --preset llama3-8b-4l --compile --recipes tensorwise,rowwise --out $OUT/train.json"
    "memory|30|$PY -m pytest -q tests/test_memory.py -p no:cacheprovider"
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
    IFS='|' read -r name limit cmd <<<"$step"
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
    json+="{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $secs, \"limit_s\": $limit, \"command\": \"$cmd\"},"
    table+="| $name | $rc | $secs | \`$cmd\` |\n"
done
json="${json%,}]"
echo "$json" >"$OUT/steps.json"

{
    echo "# float8kit GPU acceptance$([ $DRY -eq 1 ] && echo ' (dry run: commands checked, nothing run)')"
    echo
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
