#!/usr/bin/env bash
# PD TTFT at concurrency 1 with issue 30's checks on vs off, alternating stacks (A B A B), one at a time.
# on:  --api-key (KVPIPE_API_KEY), the stack's auth token (launch always makes one), --disaggregation-bootstrap-allow
# off: no API key, no allow list (the auth token stays: launch makes one; it was there before issue 30 too)
set -u
cd "$(dirname "$0")/.."
export MC_LOG_LEVEL=WARNING
OUT=${1:-/tmp/kvpipe-security-ttft}; mkdir -p $OUT
M=$OUT/tiny; [ -d $M ] || .venv/bin/kvpipe init-model --preset tiny --out $M >/dev/null
for round in 1 2; do
  for mode in on off; do
    port=$(.venv/bin/python -c 'from kvpipe.launch.ports import free_port; print(free_port())')  # no fixed port: runs may share the machine
    if [ $mode = on ]; then
      env KVPIPE_API_KEY=abc123 .venv/bin/kvpipe launch --model-path $M --port $port --log-dir $OUT/logs-$mode-$round \
        --disaggregation-bootstrap-allow 127.0.0.1 > $OUT/launch-$mode-$round.log 2>&1 &
    else
      .venv/bin/kvpipe launch --model-path $M --port $port --log-dir $OUT/logs-$mode-$round > $OUT/launch-$mode-$round.log 2>&1 &
    fi
    pid=$!
    for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
    key=$([ $mode = on ] && echo abc123 || echo "")
    env KVPIPE_API_KEY=$key .venv/bin/kvpipe bench serve --url http://127.0.0.1:$port --prompt-lens 256 --output-lens 4 \
      --num-requests 60 --warmup-requests 5 --concurrency 1 --json --no-progress > $OUT/bench-$mode-$round.json 2> $OUT/bench-$mode-$round.err
    kill -INT $pid; wait $pid
  done
done
# TTFT of each run: summary.ttft_mean_ms / ttft_p50_ms in $OUT/bench-{on,off}-{1,2}.json
for f in $OUT/bench-*.json; do
  .venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1]))['summary']; print(sys.argv[1], round(s['ttft_mean_ms'],2), round(s['ttft_p50_ms'],2))" $f
done
