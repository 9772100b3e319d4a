#!/bin/bash
# The table of docs/levers.md, "Full fine-tune and LoRA, with and without checkpointing":
# GPT-2 124M (random init, recipes/train_lm.py --size gpt2), 2 processes, micro-batch 8 x 512,
# fp32, 2 steps each, {full, LoRA r=8} x {plain, checkpointed} x {DDP, ZeRO-2, FSDP2
# full-shard}; then `dpkit plan --against` each run. Needs ~9 GB of RAM per process on CPU.
#   bash docs/scripts/levers_gpt2_table.sh OUT_DIR
set -u
out=${1:?usage: levers_gpt2_table.sh OUT_DIR}
mkdir -p "$out"
for strategy in ddp zero2 fsdp2_full_shard; do
  for lora in "" "--lora-r 8"; do
    for ckpt in "" "--gradient-checkpointing"; do
      name=$strategy$([ -n "$lora" ] && echo -lora)$([ -n "$ckpt" ] && echo -ckpt)
      torchrun --nproc_per_node 2 recipes/train_lm.py --size gpt2 --seq-len 512 \
        --micro-batch-size 8 --max-steps 2 --strategy $strategy $lora $ckpt \
        --output-dir "$out/$name" --overwrite-output-dir > "$out/$name.log" 2>&1
      echo "$name rc=$?"
      dpkit plan --against "$out/$name" --json > "$out/$name.plan.json" 2>> "$out/$name.log"
    done
  done
done
python "$(dirname "$0")/levers_gpt2_table.py" "$out"
