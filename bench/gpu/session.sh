#!/usr/bin/env bash
# A GPU session's measurements, prepared so that each phase is one `device run` call:
# GPU time comes in short leases (minutes), and a lease spent typing commands, installing
# or fetching results by hand is lost to the measurements.
#
#     bash bench/gpu/fetch_wheels.sh                     # here, once: what the GPU image lacks
#     bash bench/gpu/session.sh speed                    # on the GPU (carry bench/gpu/wheels)
#     bash bench/gpu/session.sh planner                  # a second call, if time is left
#     PHASE_SECONDS=240 bash bench/gpu/session.sh planner  # ... cut to what the lease has left (status)
#     bash bench/gpu/session.sh all --tiny               # anywhere: the same commands, tiny, on the CPU
#
# Phases, most important first, each within 9.5 minutes (`run` with timeout_s=600; a
# step has its own time limit, and one that fails or runs out of time leaves the others
# to run; train.py writes its JSON after every side, so a cut run keeps what it finished):
#   speed    bench/gpu/train.py, the 1.11B GPT then the 1.10B Llama, Interleaf's compiled
#            bf16 and float8 sides against the strongest peer of each precision (per-block
#            compile, torchtitan's FSDP2+compile recipe and its float8 one), the profile of
#            every side's last step, reduced here to its kernel categories and each
#            Interleaf side's kernels against its peer's (profile_breakdown.py); then
#            memory_check.py on both results (no GPU needed: the sides recorded their
#            device peaks).
#   planner  bench/planner.py on one GPU server (its predictions against measured steps,
#            and the planned job's device peak against the memory model), float8's losses
#            against bf16's over 200 steps of a smaller GPT (fp8_tracking.py), then the memory
#            cases: compiled selective recompute in bf16 and float8, and the 2.7B one
#            (admission's refusal on an 80 GB H100, or not), each with what it held at
#            its peak (memory_check.py --peak-breakdown).
#
# Results go to $OUT (the device tool's folder; default bench/results/gpu/session), at
# most 8 files, as the device tool brings back: session.log, report.md (every result as
# Markdown tables, bench/gpu/report.py), train_gpt2.json, train_llama.json,
# memory_train.json, profile.png, profile_breakdown.json in `speed`; planner.json,
# memory_cases.json and fp8_tracking.json in `planner`. The raw profiler traces stay on the
# machine (tens of MB); their kernel categories come back.
set -uo pipefail
cd "$(dirname "$0")/../.."

phase=${1:?usage: session.sh speed|planner|all [--tiny]}
tiny=${2:-}
case "$phase $tiny" in  # before anything is written
    "speed "|"planner "|"all "|"speed --tiny"|"planner --tiny"|"all --tiny") ;;
    *) echo "usage: session.sh speed|planner|all [--tiny], not: $*" >&2; exit 2 ;;
esac
OUT=${OUT:-bench/results/gpu/session}
mkdir -p "$OUT"
log="$OUT/session.log"
failed=()
traces=$(mktemp -d)
trap 'rm -rf "$traces"' EXIT

if [[ "$tiny" == "--tiny" ]]; then
    device=(--device cpu --tiny)
    limit() { echo 300; }
else
    device=()
    limit() { echo "$1"; }
    if [[ -d bench/gpu/wheels ]]; then  # the image's python3 with the carried wheels first
        python3 -m pip install --quiet --no-index --no-deps --target /tmp/interleaf-site bench/gpu/wheels/*.whl \
            >>"$log" 2>&1 || echo "installing bench/gpu/wheels failed" | tee -a "$log"
        export PYTHONPATH=/tmp/interleaf-site
    fi
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

PHASE_SECONDS=${PHASE_SECONDS:-560}  # a phase's steps end by then: the device tool's 600 s, less a margin
KILL_AFTER=15  # after a step's SIGTERM: the bench stops its cluster (interleaf_run.exit_cleanly_on_sigterm)
deadline=0
phases=0
# The first phase counts from the script's start (the wheels' install included), a later one from its own.
begin_phase() { deadline=$(( (phases++ ? SECONDS : 0) + PHASE_SECONDS )); }

step() {  # step NAME SECONDS COMMAND...: runs COMMAND within SECONDS (and the phase's
          # deadline; "rest": all of what is left but RESERVE seconds), logs its rc and time;
          # skipped where less than MINIMUM seconds are left, which would end it before it
          # wrote anything (a device second spent for nothing)
    local name=$1 seconds=$2; shift 2
    local left=$((deadline - SECONDS - KILL_AFTER))
    [[ "$seconds" == rest ]] && seconds=$((left - RESERVE))
    (( seconds > left )) && seconds=$left
    if (( seconds < ${MINIMUM:-10} )); then
        echo "== $name: skipped, $((deadline - SECONDS)) s left of the phase, $name needs ${MINIMUM:-10}" \
            | tee -a "$log"
        failed+=("$name")
        return
    fi
    local start=$SECONDS
    echo "== $name: $*" | tee -a "$log"
    timeout --kill-after="$KILL_AFTER" "$seconds" "$@" 2>&1 | tee -a "$log" | tail -n 25
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$log"
    (( rc == 0 )) || failed+=("$name")
}

RESERVE=0

speed() {
    begin_phase
    # bf16 and float8, each Interleaf side against the strongest peers of its precision
    # (docs/gpus.md#speed): per-block compile and torchtitan's recipes.
    local sides=compile,fsdp2-compile,interleaf-compile,fsdp2-compile-fp8,interleaf-fp8
    # Every side's last step profiled on the GPT only: each profile's export and gzip
    # take seconds the Llama run, which took 214 s unprofiled on the last H200, cannot
    # spare, and the GPT's sides answer where Interleaf's step differs from its peers'.
    step train-gpt2 "$(limit 300)" python3 bench/gpu/train.py --arch gpt2 --sides "$sides" --steps 8 --warmup 3 \
        --profile-dir "$traces/gpt2" --out "$OUT/train_gpt2.json" ${device[@]+"${device[@]}"}
    # The rest of the phase but what the two cheap steps after it need (8 and 3 s on the
    # last H200 run, when two traces were reduced where now five are).
    RESERVE=45 step train-llama rest python3 bench/gpu/train.py --arch llama --sides "$sides" --steps 8 --warmup 3 \
        --out "$OUT/train_llama.json" ${device[@]+"${device[@]}"}
    # Tiny sides ran on the CPU, where no device peak exists: the check then reads the
    # committed GPU run's results, so that its code still runs.
    local results=()
    for arch in gpt2 llama; do
        if [[ "$tiny" == "--tiny" ]]; then
            results+=("bench/results/gpu/train_$arch.json")
        elif [[ -f "$OUT/train_$arch.json" ]]; then
            results+=("$OUT/train_$arch.json")
        fi
    done
    (( ${#results[@]} )) && step memory 40 python3 bench/gpu/memory_check.py --train-json "${results[@]}" \
        --out "$OUT/memory_train.json"
    # Every side's profiled step by its name (docs/gpus.md's table); each Interleaf side
    # also against the peer it was ranked with last time, kernel by kernel
    # (profile_breakdown.py --against).
    local profiled=() against=()
    for side in ${sides//,/ }; do
        [[ -s "$traces/gpt2/profile_$side.json.gz" ]] && profiled+=("$side=$traces/gpt2/profile_$side.json.gz")
    done
    for pair in interleaf-compile,compile interleaf-fp8,fsdp2-compile-fp8; do
        [[ -s "$traces/gpt2/profile_${pair%,*}.json.gz" && -s "$traces/gpt2/profile_${pair#*,}.json.gz" ]] \
            && against+=(--against "$pair")
    done
    if [[ "$tiny" == "--tiny" ]]; then
        echo "== profile: skipped, tiny (CPU traces hold no GPU kernels): ${#profiled[@]} traces," \
             "${against[*]-no pairs}" | tee -a "$log"
    elif (( ${#profiled[@]} )); then
        step profile 90 python3 bench/gpu/profile_breakdown.py "${profiled[@]}" ${against[@]+"${against[@]}"} \
            --png "$OUT/profile.png" --json "$OUT/profile_breakdown.json"
    fi
}

planner() {
    begin_phase
    if [[ "$tiny" == "--tiny" ]]; then
        step planner 300 python3 bench/planner.py --tiny --out "$OUT/planner.json"
        step memory-cases 300 python3 bench/gpu/memory_check.py --out "$OUT/memory_cases.json" "${device[@]}"
        step fp8-tracking 300 python3 bench/gpu/fp8_tracking.py --out "$OUT/fp8_tracking.json" "${device[@]}"
    else
        # One round of the grid and one playoff: a GPU's steps vary little between runs,
        # and the lease is short.
        step planner 330 python3 bench/planner.py --device cuda --servers 1 --steps 6 --warmup 2 --rounds 1 \
            --playoff-rounds 1 --out "$OUT/planner.json"
        # Float8's losses against bf16's over 200 steps of a smaller GPT (the speed run's
        # 8 steps cannot show a drift): two compilations and 400 steps, about 2 minutes
        # (not yet timed on a GPU), before the memory cases, which were measured once
        # already; each job also records what its second step held at its peak, in case
        # no time is left for the memory cases.
        # Its first result is written after the bf16 job (a compilation and 200 steps):
        # with less than MINIMUM left it would be cut before.
        MINIMUM=100 step fp8-tracking 210 python3 bench/gpu/fp8_tracking.py --out "$OUT/fp8_tracking.json"
        # Compiled selective recompute (its blocks compiled with their checkpoints) in bf16
        # and float8, then the 2.7B case admission refused on an 80 GB H100: with what the
        # two steps above leave of the phase, which is little where they take their limits
        # (a skipped step counts as failed).
        # --peak-breakdown: what each held at its peak, by where it was allocated (the
        # float8 rows exceed the model by 0.6 GiB: docs/gpus.md).
        # One case took 25-40 s on the last H200 run.
        MINIMUM=45 step memory-cases rest python3 bench/gpu/memory_check.py --peak-breakdown \
            --cases gpt2-1.1b-compiled-selective,gpt2-1.1b-fp8-compiled-selective,gpt2-2.7b-full \
            --out "$OUT/memory_cases.json"
    fi
}

{ echo "session.sh $phase $tiny: $(date -u +%FT%TZ), tree $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; } \
    | tee -a "$log"
case $phase in
    speed) speed ;;
    planner) planner ;;
    all) speed; planner ;;
esac
# The results as docs/gpus.md's Markdown tables, in the log and beside it.
python3 bench/gpu/report.py "$OUT" > "$OUT/report.md" 2>>"$log" || failed+=(report)
cat "$OUT/report.md"
ls -l "$OUT" | tee -a "$log"
# A non-zero exit when any step failed, so a caller (and the test of --tiny) sees it.
if (( ${#failed[@]} )); then
    echo "failed: ${failed[*]}" | tee -a "$log"
    exit 1
fi
