#!/bin/bash
# The tables of docs/finetune_lm.md: a small Llama-style decoder (docs/scripts/small_decoder.py:
# 4 layers, width 256, a 4,096-token BPE vocabulary, random init) fine-tuned on the embedded
# Shakespeare text, packed into blocks of 256 tokens, 2 processes, micro-batch 4, fp32,
# dropout 0, 40 steps; {full, LoRA r=8} x {DDP, ZeRO-2, FSDP2 full-shard}, each checked with
# `dpkit plan --against`; and the decoder as built, evaluated only (the starting perplexity).
#   bash docs/scripts/finetune_lm_table.sh OUT_DIR
set -u
out=${1:?usage: finetune_lm_table.sh OUT_DIR}
here=$(dirname "$0")
mkdir -p "$out"
[ -d "$out/decoder" ] || python "$here/small_decoder.py" "$out/decoder" > /dev/null
common=(--model "$out/decoder" --dataset shakespeare --packing --max-seq-length 256
        --max-train-samples 6000 --max-eval-samples 600 --micro-batch-size 4
        --learning-rate 1e-3 --warmup-ratio 0.1 --dropout 0 --max-steps 40 --eval-steps 20
        --logging-steps 10 --no-save-checkpoints --no-save-model --overwrite-output-dir)
torchrun --nproc_per_node 2 recipes/finetune_lm.py "${common[@]}" --eval-only \
  --output-dir "$out/as-built" > "$out/as-built.log" 2>&1
echo "as-built rc=$?"
for strategy in ddp zero2 fsdp2_full_shard; do
  for lora in "" "--lora-r 8 --learning-rate 3e-3"; do
    name=$strategy$([ -n "$lora" ] && echo -lora)
    # shellcheck disable=SC2086
    torchrun --nproc_per_node 2 recipes/finetune_lm.py "${common[@]}" --strategy $strategy \
      $lora --output-dir "$out/$name" > "$out/$name.log" 2>&1
    echo "$name rc=$?"
    dpkit plan --against "$out/$name" --json > "$out/$name.plan.json" 2>> "$out/$name.log"
  done
done
python "$here/finetune_lm_table.py" "$out"
