#!/bin/bash
# The table of docs/offload.md, "GPT-2 124M and 355M: every strategy side by side": GPT-2 124M and
# 355M (random init, recipes/train_lm.py --size gpt2 / gpt2-medium), synthetic tokens,
# fp32, micro-batch 2 x 128 tokens, 3 steps, seed 42 (the recipe's default: every run
# starts from the same weights and reads the same batches), 2 and 4 processes, under
# ddp, zero2, zero2_offload, zero3, zero3_offload, fsdp2_full_shard and
# fsdp2_full_shard_offload; then `dpkit plan --against` each run, then the table
# (docs/scripts/offload_gpt2_table.py).
#
# Skipped: 355M at 4 processes, every strategy. On CPU each rank's host and "device"
# share one RAM, so the 4 ranks add up on a 24 GiB machine. `dpkit plan --model
# gpt2-medium --gpus-per-node 4 --precision fp32 --micro-batch 2 --seq-len 128` (planned,
# not measured) gives DDP a later-step peak of 6.25 GiB of live tensors per rank: 25.0 GiB
# for 4, over the machine before any process runtime. The others plan 2.3 (FSDP2
# full-shard) to 4.3 GiB (ZeRO-2 and ZeRO-3 offload: peak plus host states) per rank,
# 9-17 GiB for 4, before ~1 GiB of runtime per process (torch, DeepSpeed) and the fp32
# model each process builds at start-up: too close to 24 GiB to run beside other work,
# and without the DDP run the loss column would have no reference.
#
#   bash docs/scripts/offload_gpt2_table.sh OUT_DIR
#   SIZES="gpt2" NPROCS="2" nice -n 19 bash docs/scripts/offload_gpt2_table.sh OUT_DIR
#
# SIZES (default "gpt2 gpt2-medium") and NPROCS (default "2 4") pick a subset of the
# matrix; the table prints the rows that ran. Run it from the repository root with
# dpkit's environment (torchrun and python on PATH). One launch at a time: each is timed
# (wall seconds in OUT_DIR/runs.txt), and on a shared machine parallel runs would time
# each other.
set -u
out=${1:?usage: offload_gpt2_table.sh OUT_DIR}
sizes=${SIZES:-gpt2 gpt2-medium}
nprocs=${NPROCS:-2 4}
mkdir -p "$out"
for model in $sizes; do
  for n in $nprocs; do
    [ "$model" = gpt2-medium ] && [ "$n" = 4 ] && continue # the RAM: see above
    # DDP first: the table's loss column compares each strategy with it.
    for strategy in ddp zero2 zero2_offload zero3 zero3_offload fsdp2_full_shard \
      fsdp2_full_shard_offload; do
      name=$model-n$n-$strategy
      start=$SECONDS
      torchrun --nproc_per_node "$n" recipes/train_lm.py --size "$model" --synthetic \
        --seq-len 128 --micro-batch-size 2 --max-steps 3 --strategy "$strategy" \
        --output-dir "$out/$name" --overwrite-output-dir > "$out/$name.log" 2>&1
      rc=$?
      echo "$name rc=$rc wall=$((SECONDS - start))s" | tee -a "$out/runs.txt"
      python -m dpkit plan --against "$out/$name" --json > "$out/$name.plan.json" \
        2>> "$out/$name.log"
    done
  done
done
python "$(dirname "$0")/offload_gpt2_table.py" "$out"
