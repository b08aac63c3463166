#!/usr/bin/env bash
# Measured vs predicted step time and peak memory of emitted programs on one GPU.
#
#   benchmarks/gpu_check.sh prepare   # where autopar is installed: plan the cases, emit programs
#   benchmarks/gpu_check.sh run       # on the GPU machine (needs only python3 with CUDA torch)
#   benchmarks/gpu_check.sh refit     # where autopar is, with the runs' folders copied back
#   benchmarks/gpu_check.sh           # all three, on a machine that has autopar and a GPU
#
# The two halves are the workflow autopar is for: plan anywhere (the planner needs no GPU and no
# weights), run the emitted train.py where the GPUs are. `prepare` writes one folder per case
# under $GPU_CHECK_DIR (default benchmarks/gpu_check_out, git-ignored); `run` runs each with
# torchrun on one GPU for $GPU_CHECK_STEPS steps (default 20) and prints, per case, the plan's
# predicted step time and peak memory beside the measured ones (median step time over the steps
# after the first 5; peak = torch.cuda.max_memory_allocated). The cases are the shapes one GPU
# allows: the planner's free choice, every layer checkpointed, and 4 accumulation microbatches.
# Each run also profiles $GPU_CHECK_PROFILE_STEPS steps (default 5, after train.py's warm-up)
# into its folder's profile.json: per-layer forward/backward, collectives, optimizer, data wait
# and memory split as the cost model splits it. `refit` closes the loop: it fits the cost model
# to the first case's profile alone (`plan --refit`, written to $GPU_CHECK_DIR/refit-profile.json,
# then usable as `plan --profile` for this GPU), predicts every case again with it, and prints
# measured, predicted before and after the refit, and the median |error| of the cases the refit
# did not see (benchmarks/refit.py --cases): the first run on a GPU calibrates the model.
#
# GPU_CHECK_CLUSTER (default H200) and GPU_CHECK_SIZE=small (a 4-layer, d=64 GPT instead of a
# 24-layer d=2048 one, ~1.3B parameters) let the same script run on a CPU for a dry run:
#   GPU_CHECK_CLUSTER=cpu:1 GPU_CHECK_SIZE=small GPU_CHECK_STEPS=8 GPU_CHECK_PROFILE_STEPS=3 benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${GPU_CHECK_DIR:-benchmarks/gpu_check_out}
CLUSTER=${GPU_CHECK_CLUSTER:-H200}
STEPS=${GPU_CHECK_STEPS:-20}
PROFILE_STEPS=${GPU_CHECK_PROFILE_STEPS:-5}
PYTHON=${PYTHON:-python3}
if [ "${GPU_CHECK_SIZE:-}" = small ]; then
    export GPT_LAYERS=4 GPT_DIM=64 GPT_HEADS=4 GPT_VOCAB=256 GPT_MAX_SEQ=128
    BATCH=8 SEQ=128 DTYPE=fp32
else
    export GPT_LAYERS=24 GPT_DIM=2048 GPT_HEADS=16 GPT_VOCAB=50304 GPT_MAX_SEQ=2048
    BATCH=8 SEQ=2048 DTYPE=bf16
fi
# name and the flags that pin it
CASES=("free:" "ckpt-full:--checkpoint full" "accum4:--microbatches 4")

prepare() {
    local plan_cmd=${PLAN:-plan}
    command -v "$plan_cmd" >/dev/null || plan_cmd=.venv/bin/plan
    mkdir -p "$DIR"
    for case in "${CASES[@]}"; do
        local name=${case%%:*} flags=${case#*:}
        # shellcheck disable=SC2086
        "$plan_cmd" examples/gpt.py --cluster "$CLUSTER" --global-batch "$BATCH" --seq-len "$SEQ" \
            --dtype "$DTYPE" $flags --out "$DIR/$name" -q
        # the run half may have no autopar: the sizes travel with the case
        env | grep '^GPT_' >"$DIR/$name/sizes.env"
        echo "planned $name -> $DIR/$name"
    done
}

run() {
    for case in "${CASES[@]}"; do
        local name=${case%%:*}
        [ -f "$DIR/$name/train.py" ] || { echo "error: $DIR/$name/train.py missing: run '$0 prepare' first" >&2; exit 2; }
        set -a
        # shellcheck disable=SC1090
        . "$DIR/$name/sizes.env"
        set +a
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 "$DIR/$name/train.py" \
            --steps "$STEPS" --log-every 1 --profile-steps "$PROFILE_STEPS" \
            --profile-out "$DIR/$name/profile.json" >"$DIR/$name/run.log" 2>&1 ||
            { echo "error: case $name failed; the end of $DIR/$name/run.log:" >&2; tail -20 "$DIR/$name/run.log" >&2; exit 1; }
    done
    local names=()
    for case in "${CASES[@]}"; do names+=("$DIR/${case%%:*}"); done
    "$PYTHON" benchmarks/gpu_compare.py "${names[@]}"
}

refit() {
    local plan_cmd=${PLAN:-plan} python=${PYTHON_AUTOPAR:-python3}
    command -v "$plan_cmd" >/dev/null || plan_cmd=.venv/bin/plan
    [ -x .venv/bin/python ] && [ -z "${PYTHON_AUTOPAR:-}" ] && python=.venv/bin/python
    local names=() first=${CASES[0]}
    for case in "${CASES[@]}"; do
        local name=${case%%:*}
        [ -f "$DIR/$name/profile.json" ] || { echo "error: $DIR/$name/profile.json missing: run '$0 run' first (and copy the case folders back)" >&2; exit 2; }
        names+=("$DIR/$name")
    done
    local flags=${first#*:}
    echo "re-planned ${first%%:*} with the cost model refitted from its run:"
    # shellcheck disable=SC2086
    "$plan_cmd" examples/gpt.py --cluster "$CLUSTER" --global-batch "$BATCH" --seq-len "$SEQ" \
        --dtype "$DTYPE" $flags --refit "$DIR/${first%%:*}/profile.json" \
        --refit-out "$DIR/refit-profile.json" | sed 's/^/  /'
    "$python" benchmarks/refit.py --cases "${names[@]}" --fitted "$DIR/refit-profile.json"
}

case "${1:-all}" in
    prepare) prepare ;;
    run) run ;;
    refit) refit ;;
    all) prepare && run && refit ;;
    *) echo "usage: $0 [prepare|run|refit|all]" >&2; exit 2 ;;
esac
