#!/bin/bash
# The save-cost table of docs/checkpoints.md: MiniLM, GPT-2 124M and 355M (random init), DDP,
# ZeRO-2 and FSDP2 full-shard, 2 and 4 processes (355M: 2 only, the RAM of a 24 GiB machine),
# sharded and full; two saves each (docs/scripts/checkpoint_save_cost.py), then the table.
#   bash docs/scripts/checkpoint_save_cost.sh OUT_DIR
set -u
out=${1:?usage: checkpoint_save_cost.sh OUT_DIR}
mkdir -p "$out"
for model in minilm gpt2 gpt2-medium; do
  for n in 2 4; do
    [ "$model" = gpt2-medium ] && [ "$n" = 4 ] && continue
    for strategy in ddp zero2 fsdp2_full_shard; do
      for format in sharded full; do
        name=$model-$strategy-n$n-$format
        size=$([ "$model" = minilm ] && echo "tiny --minilm" || echo "$model")
        torchrun --nproc_per_node "$n" docs/scripts/checkpoint_save_cost.py --size $size \
          --synthetic --strategy "$strategy" --checkpoint-format "$format" \
          --output-dir "$out/$name" > "$out/$name.log" 2>&1
        echo "$name rc=$?"
        rm -rf "$out/$name/checkpoints"  # the figures are in checkpoint_log.jsonl
      done
    done
  done
done
python "$(dirname "$0")/checkpoint_save_cost_table.py" "$out"
