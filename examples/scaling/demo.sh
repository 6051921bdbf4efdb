#!/usr/bin/env bash
# Elastic rollout engines during a fully-async training: 1 -> 3 -> 1 engines through the scaling REST API.
# Run from the repository root after the quickstart exists (bash scripts/quickstart.sh builds it):
#   bash examples/scaling/demo.sh > docs/scaling_demo.log 2>&1
set -euo pipefail
. .venv/bin/activate
PORT=${PORT:-8100}
URL=http://127.0.0.1:$PORT
export RELAX_API_KEY=${RELAX_API_KEY:-demo-token}
OUT=${OUT:-runs/scaling_demo}
rm -rf "$OUT"; mkdir -p "$(dirname "$OUT")"

echo "== relax train --fully-async --max-staleness 1 --rollout-api-port $PORT (120 steps of the quickstart)"
relax train --config examples/quickstart/config.yaml --fully-async --max-staleness 1 --num-rollout 120 \
  --eval-interval 60 --rollout-api-port "$PORT" --rollout-api-key "$RELAX_API_KEY" --output-dir "$OUT" \
  > "$OUT.train.log" 2>&1 &
TRAIN=$!
for _ in $(seq 1 600); do curl -sf "$URL/engines" > /dev/null && break; sleep 0.2; done

step() { tail -n 400 "$OUT/run.log" | grep -o 'step [0-9]*:' | tail -n 1; }
sleep 8
echo "== $(step) scale out to 3 engines"
relax scale out --url "$URL" --num-replicas 3
relax scale engines --url "$URL"
sleep 15
echo "== $(step) scale back in to 1 engine"
relax scale in --url "$URL" --num-replicas 1
relax scale engines --url "$URL"
wait "$TRAIN"
echo "== training finished"
grep -E "held-out accuracy|run directory" "$OUT.train.log"
python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
steps = [r for r in rows if "data/produced_groups" in r]
produced = sum(r["data/produced_groups"] for r in steps)
consumed = sum(r["data/consumed_groups"] for r in steps)
dropped = sum(v for r in steps for k, v in r.items() if k.startswith("data/dropped_"))
print(f"steps trained: {len(steps)} (1..{steps[-1]['step']}); groups produced {produced:.0f}, "
      f"trained {consumed:.0f}, dropped {dropped:.0f}")
PY
