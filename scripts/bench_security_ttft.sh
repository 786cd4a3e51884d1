#!/usr/bin/env bash
# PD TTFT at concurrency 1 with the switchable security checks on vs off, alternating stacks (A B A B),
# one at a time (issue 45's acceptance: < 1 ms apart; KV integrity excluded, measured per MB apart).
# on:  what `kvpipe launch` does by default (fresh user and admin API keys, the router's control-plane
#      key) plus --disaggregation-bootstrap-allow 127.0.0.1 and --cache-salt-by-api-key
# off: --no-api-keys, no allow list, no salt
# Both keep what has no off switch: the stack's PD token, endpoint-bound signatures, the registration
# challenge, room claims, per-session frame checks and limits, the HTTP field caps and listener limits.
set -u
cd "$(dirname "$0")/.."
export MC_LOG_LEVEL=WARNING
OUT=${1:-/tmp/kvpipe-security-ttft}; mkdir -p $OUT
N=${N:-60}
M=$OUT/tiny; [ -d $M ] || .venv/bin/kvpipe init-model --preset tiny --out $M >/dev/null
ROUNDS=${ROUNDS:-2}
for round in $(seq 1 $ROUNDS); do
  for mode in on off; do
    port=$(.venv/bin/python -c 'from kvpipe.launch.ports import free_port; print(free_port())')  # no fixed port: runs may share the machine
    if [ $mode = on ]; then
      flags="--disaggregation-bootstrap-allow 127.0.0.1 --cache-salt-by-api-key"
    else
      flags="--no-api-keys"
    fi
    .venv/bin/kvpipe launch --model-path $M --port $port --log-dir $OUT/logs-$mode-$round $flags \
      > $OUT/launch-$mode-$round.log 2>&1 &
    pid=$!
    for i in $(seq 1 180); do grep -q "ready" $OUT/launch-$mode-$round.log && break; sleep 1; done
    # bench serve finds a launched stack's keys by its URL (kvpipe/server/client_keys.py)
    .venv/bin/kvpipe bench serve --url http://127.0.0.1:$port --prompt-lens 256 --output-lens 4 \
      --num-requests $N --warmup-requests 5 --concurrency 1 --json --no-progress > $OUT/bench-$mode-$round.json 2> $OUT/bench-$mode-$round.err
    kill -INT $pid; wait $pid
  done
done
# TTFT of each run: summary.ttft_mean_ms / ttft_p50_ms in $OUT/bench-{on,off}-N.json
for f in $OUT/bench-*.json; do
  .venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1]))['summary']; print(sys.argv[1], round(s['ttft_mean_ms'],2), round(s['ttft_p50_ms'],2))" $f
done
