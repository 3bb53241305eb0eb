#!/usr/bin/env bash
# Issue 20's measurements in one device call: the KDA kernels' gate-regime grid beside fla-core 0.6, and on request
# the full-size GPU checks, fla's own KDA test file and an A/B of source trees.
#     bash bench/kda_grid.sh OUT                     # the grid (both shapes, forward and forward + backward)
#     bash bench/kda_grid.sh OUT --card H200         # exit at once (status 0) unless the card's name has "H200"
#     bash bench/kda_grid.sh OUT --check --fla-tests # then the full-size checks, then fla's test file
#     bash bench/kda_grid.sh OUT --no-grid --ab .gl/ab53 --backward   # an A/B of bench/kda_ab.py trees only
#     bash bench/kda_grid.sh OUT --no-grid --ab .gl/ab57 --ab-shape 1x32768   # the A/B at one shape (kda_ab --shape)
#     bash bench/kda_grid.sh OUT -- --shapes 16x2048 --budget 170     # after --: more kda_kernels.py arguments
# fla-core 0.6 (pure Python) is installed into /tmp/site from .whl/ or .fla/wheels/ (carry one of them; a machine
# without network has no other source); fla's test file needs .fla/ (`python bench/fla_tests.py --prepare`).
# Time limits in seconds (the device's calls stop at 600): grid 380 ($GRID_S), checks 240, fla's file 200, A/B 300
# ($AB_S). Each step writes its log into OUT and prints its tail; a step cut by its limit leaves what it printed.
set -u
OUT=${1:?usage: bash bench/kda_grid.sh OUT [--card NAME] [--check] [--fla-tests] [--no-grid] [--ab DIR [--backward] [--ab-shape BxT]] [-- ARGS]}
shift
CARD="" CHECK=0 FLA=0 GRID=1 AB="" AB_ARGS=() EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --card) CARD=${2:?--card takes a name, e.g. H200}; shift ;;
        --check) CHECK=1 ;;
        --fla-tests) FLA=1 ;;
        --no-grid) GRID=0 ;;
        --ab) AB=${2:?--ab takes a folder of bench/kda_ab.py trees}; shift ;;
        --backward) AB_ARGS+=(--backward) ;;
        --ab-shape) AB_ARGS+=(--shape "${2:?--ab-shape takes a shape BxT, e.g. 1x32768}"); shift ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "bench/kda_grid.sh: unknown argument $1 (see the header of this script)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "card: ${GPU:-none}; $(date -u)"
if [ -n "$CARD" ] && [[ "$GPU" != *"$CARD"* ]]; then
    echo "not a $CARD: nothing run"
    exit 0
fi
SITE=/tmp/site
if ! PYTHONPATH=$SITE "$PY" -c "import fla" 2>/dev/null; then
    WHEELS=$(ls .fla/wheels/*.whl 2>/dev/null || ls .whl/*.whl 2>/dev/null)   # one folder: pip refuses a wheel twice
    if [ -n "$WHEELS" ]; then
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --no-deps --no-index --target "$SITE" $WHEELS 2>&1 | grep -v WARNING
    else
        echo "no fla-core wheel in .whl/ or .fla/wheels/: the grid runs without fla's columns"
    fi
fi
step() {   # step NAME LIMIT CMD...: run CMD with a time limit, its output into OUT/NAME.log, print its tail
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? ($(date -u +%T))"
    grep -v '^\s*$' "$OUT/$name.log" | tail -"${TAIL:-40}"
}
if [ "$GRID" = 1 ]; then
    PYTHONPATH=$SITE:src TAIL=30 step grid "${GRID_S:-380}" "$PY" bench/kda_kernels.py --regimes --no-decode \
        --budget $(( ${GRID_S:-380} - 20 )) --out "$OUT/grid" "${EXTRA[@]}"
fi
if [ "$CHECK" = 1 ]; then
    PYTHONPATH=src TAIL=5 step check 240 "$PY" bench/kda_kernels.py --check --only check --no-decode --no-fla \
        --out "$OUT/check"
fi
if [ "$FLA" = 1 ]; then
    PYTHONPATH=src TAIL=22 step fla_tests 200 "$PY" bench/fla_tests.py --jobs 8 --budget 150
fi
if [ -n "$AB" ]; then
    PYTHONPATH=src TAIL=3 step ab "${AB_S:-300}" "$PY" bench/kda_ab.py run "$AB" --rounds 2 ${AB_ARGS[@]+"${AB_ARGS[@]}"} \
        --save "$OUT/ab.json"
    PYTHONPATH=src "$PY" bench/kda_ab.py table "$OUT/ab.json" | grep -v '^$'
fi
