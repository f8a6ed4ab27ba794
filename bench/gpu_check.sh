#!/usr/bin/env bash
# The GPU check, one run (about 5 minutes on one H100; no network, no weights: the backbones are the real
# architectures with random weights, `random:<shape>`, which cost a step's real time and memory):
#
#   1. the train step on CUDA in bf16 (LOPD, OPSD, GRPO; SmolLM2-135M's shape at 2k, 8k and 16k tokens and
#      Qwen3-4B's at 8k and 16k, LoRA, checkpointing on): peak memory (max_memory_allocated) beside the memory
#      model's prediction (lopd_core.memory_model), step time and tokens/s, the median of the steps after the first;
#   2. FSDP2 on one rank: the fully fine-tuned step sharded under a one-rank process group (NCCL), its loss and
#      gradient norm beside the same step unsharded;
#   3. the fused loss head's memory at 4k and 16k tokens (V = 151,936, Qwen3's), against the naive head.
#
#   bash bench/gpu_check.sh [OUT_DIR]        # OUT_DIR: default $OUT, else runs/gpu_check; rows land in *.jsonl
#
# Without CUDA it runs the same three checks on the CPU at toy sizes (tiny backbone, short lengths, a small
# vocabulary) and says so: the script and its benches are tested on every machine (tests/core/test_gpu_check.py).
# Prints one JSON line per check, and `{"check": "done", ...}` last. Exit status: non-zero when a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  DEVICE=cuda DTYPE=bfloat16 STEPS=3
  SMALL=random:SmolLM2-135M LARGE=random:Qwen3-4B SMALL_LENGTHS="2048 8192 16384" LARGE_LENGTHS="8192 16384"
  HEAD_LENGTHS="4096 16384" VOCAB=151936 HIDDEN=2560
else
  DEVICE=cpu DTYPE=float32 STEPS=2
  SMALL=tiny LARGE="" SMALL_LENGTHS="256" LARGE_LENGTHS="" HEAD_LENGTHS="256 512" VOCAB=2048 HIDDEN=64
fi
"$PY" - "$DEVICE" <<'EOF'
import json, sys, torch
device = sys.argv[1]
info = {"check": "environment", "device": device, "torch": torch.__version__}
if device == "cuda":
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_gb=round(p.total_memory / 2**30, 1))
else:
    info["note"] = "no CUDA here: every check runs at toy sizes on the CPU; the CUDA figures need a GPU machine"
print(json.dumps(info))
EOF

rm -f "$OUT_DIR"/*.jsonl "$OUT_DIR"/*.log "$OUT_DIR"/head.*
t0=$(date +%s)
# 1. the train step
"$PY" bench/step_memory.py --backbone "$SMALL" --methods lopd opsd grpo --lengths $SMALL_LENGTHS --checkpointing on \
  --device "$DEVICE" --dtype "$DTYPE" --steps "$STEPS" --out "$OUT_DIR/step.jsonl" > "$OUT_DIR/step.log" 2>&1
if [ -n "$LARGE" ]; then
  "$PY" bench/step_memory.py --backbone "$LARGE" --methods lopd --lengths $LARGE_LENGTHS --checkpointing on \
    --device "$DEVICE" --dtype "$DTYPE" --steps "$STEPS" --out "$OUT_DIR/step.jsonl" >> "$OUT_DIR/step.log" 2>&1
fi
# 2. FSDP2 on one rank, beside the same step unsharded
for flag in "" --fsdp; do
  "$PY" bench/step_memory.py --backbone "$SMALL" --methods lopd --lengths ${SMALL_LENGTHS%% *} --checkpointing on \
    --student full $flag --device "$DEVICE" --dtype "$DTYPE" --steps "$STEPS" --out "$OUT_DIR/fsdp.jsonl" \
    >> "$OUT_DIR/fsdp.log" 2>&1
done
# 3. the loss head
"$PY" bench/loss_memory.py --cases lopd --lengths $HEAD_LENGTHS --vocab "$VOCAB" --hidden "$HIDDEN" \
  --device "$DEVICE" --dtype "$DTYPE" > "$OUT_DIR/head.log" 2> "$OUT_DIR/head.err"
head -n 1 "$OUT_DIR/head.log" > "$OUT_DIR/head.json"

"$PY" - "$OUT_DIR" "$(( $(date +%s) - t0 ))" <<'EOF'
import json, sys
from pathlib import Path
out, seconds = Path(sys.argv[1]), int(sys.argv[2])
failed = []
keys = ("backbone", "method", "length", "student_tokens", "peak_mb", "predicted_mb", "step_s", "first_step_s",
        "tokens_per_s", "device", "dtype")
for line in (out / "step.jsonl").read_text().splitlines():
    row = json.loads(line)
    if "error" in row:
        failed.append(f"step {row['backbone']} {row['method']} {row['length']}: {row['error']}")
        print(json.dumps({"check": "step", **row}))
        continue
    row = {k: row.get(k) for k in keys} | {"model_over_measured": round(row["predicted_mb"] / row["peak_mb"], 3)}
    print(json.dumps({"check": "step", **row}))
plain, sharded = (json.loads(line) for line in (out / "fsdp.jsonl").read_text().splitlines()[-2:])
fsdp = {"check": "fsdp2_one_rank", "sharded": sharded.get("sharded"), "loss": sharded.get("loss"),
        "loss_unsharded": plain.get("loss"), "grad_norm": sharded.get("grad_norm_student"),
        "grad_norm_unsharded": plain.get("grad_norm_student"), "step_s": sharded.get("step_s"),
        "step_s_unsharded": plain.get("step_s"), "peak_mb": sharded.get("peak_mb"),
        "peak_mb_unsharded": plain.get("peak_mb")}
agree = all(isinstance(fsdp[k], float) for k in ("loss", "loss_unsharded")) and \
    abs(fsdp["loss"] - fsdp["loss_unsharded"]) <= 1e-2 * max(abs(fsdp["loss_unsharded"]), 1e-6)
fsdp["agrees"] = bool(agree and fsdp["sharded"])
if not fsdp["agrees"]:
    failed.append(f"fsdp2 one rank: sharded={fsdp['sharded']}, loss {fsdp['loss']} vs {fsdp['loss_unsharded']}")
print(json.dumps(fsdp))
head = json.loads((out / "head.json").read_text())
print(json.dumps({"check": "loss_head", "vocab": head["vocab"], "device": head["device"],
                  "fused_longest_over_4k": head["fused_longest_over_4k"],
                  "rows": [{k: r.get(k) for k in ("T", "fused_gb", "naive_gb", "naive_estimated", "ratio")}
                           for r in head["rows"]]}))
print(json.dumps({"check": "done", "seconds": seconds, "failed": failed}))
sys.exit(1 if failed else 0)
EOF
