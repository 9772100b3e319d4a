#!/bin/bash
# Every variant once per round, 3 rounds, each against its round's base run.
# Run from the repository root with dpkit installed; results land in ./ddp_ab/.
set -u
script=$(dirname "$0")/ddp_settings_ab.py
mkdir -p ddp_ab
port=29611
for r in 1 2 3; do
 for v in base:'{}' big:'{"bucket_cap_mb":100}' small:'{"bucket_cap_mb":5}' static:'{"static_graph":true}' nobc:'{"broadcast_buffers":false}' thr2:'{"threads":2}'; do
  name=${v%%:*}; js=${v#*:}
  th=1; [ $name = thr2 ] && th=2
  port=$((port+1))
  OMP_NUM_THREADS=$th timeout 300 torchrun --nproc_per_node 2 --master_port $port "$script" "$js" ddp_ab/out_${name}_$r.json > ddp_ab/log_${name}_$r.txt 2>&1 || echo fail $name $r
  echo done $name $r $(date +%T)
 done
done
