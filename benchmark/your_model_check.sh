#!/usr/bin/env bash
# docs/your_model.md's recipe as one device check: a random folder of a real model's shape (by
# default SmolLM2-135M's), its target imported, a DFlash drafter trained for it on text it writes,
# then bench.py, every row checked exact; the drafter exported as speculators' folder (vLLM serves
# it), and, where speculators is installed, its logits checked against speculators' own model.
# On a lent GPU, from the project's root:
#     bash benchmark/your_model_check.sh                      # ~5 minutes budgeted on cuda
# The tests run the same script on the CPU with a tiny folder:
#     SHAPE=llama-tiny DEVICE=cpu PRESET=tiny STEPS=8 BLOCK=64 bash benchmark/your_model_check.sh
# (DATA=PATH: the corpus, else Python's standard library)
# Results go to $OUT (default ./your-model-out) and to the terminal.
set -euo pipefail
SHAPE=${SHAPE:-smollm2-135m}; DEVICE=${DEVICE:-cuda}; PRESET=${PRESET:-gpu-small}
STEPS=${STEPS:-300}; BLOCK=${BLOCK:-256}; OUT=${OUT:-your-model-out}; PY=${PY:-python3}
mkdir -p "$OUT"
folder="$OUT/$SHAPE"; run="$OUT/run-$SHAPE"
t0=$(date +%s)
$PY -m formats.pretrained "$folder" --random "$SHAPE" --force | tee "$OUT/folder.log"
common=(--init-from "$folder" --preset "$PRESET" --device "$DEVICE" --out-dir "$run"
        --block-size "$BLOCK" ${DATA:+--data "$DATA"})
# a short DFlash: a few hundred steps on a small distillation set, enough to see it draft
$PY train.py "${common[@]}" --only target 2>&1 | grep -vE "step +[0-9]+/" | tee "$OUT/train.log"
$PY train.py "${common[@]}" --only dflash --gen-seqs 64 --dflash-narrow-iters 0 \
    --dflash-iters "$STEPS" 2>&1 | grep -vE "step +[0-9]+/" | tee -a "$OUT/train.log"
echo "train seconds: $(( $(date +%s) - t0 ))" | tee -a "$OUT/train.log"
$PY bench.py --out-dir "$run" --device "$DEVICE" --methods ar,dflash,lookup --n-prompts 4 \
    --max-new-tokens 64 --repeats 1 --plot '' --json "$OUT/bench.json" 2>&1 | tail -n 8
$PY -c "import json, sys; m = json.load(open(sys.argv[1]))['methods']; \
bad = [k for k, r in m.items() if r['exact_match'] != 1.0]; \
print('every row exact' if not bad else f'NOT EXACT: {bad}'); sys.exit(1 if bad else 0)" \
    "$OUT/bench.json"
$PY -m formats.speculators export "$OUT/drafter" --out-dir "$run" --method dflash --force
if $PY -c "import speculators" 2>/dev/null; then
    $PY -m formats.speculators check "$OUT/drafter" --out-dir "$run" 2>&1 | tail -n 1
else
    echo "speculators is not installed here: the exported drafter's logits are not checked"
fi
echo "total seconds: $(( $(date +%s) - t0 ))"
