"""What one checkpoint save costs, per strategy, world size and layout: the table of docs/checkpoints.md.

A GPT-2-family model of ``--size`` (random init, lm_data's shapes) or MiniLM
(``--minilm``, the packaged sentence classifier), one optimizer step on synthetic
tokens (so that the Adam moments exist), then two saves of the whole training state with
``run.save_checkpoint``. Each save appends its line to ``<output_dir>/checkpoint_log.jsonl``:
seconds, bytes each rank wrote, and the main process's RSS added at the save's peak. The
table takes the first save's RSS (a second reuses the memory the first freed, so the
process's RSS hardly rises) and the second's seconds (the first pays for first use).

    torchrun --nproc_per_node 2 docs/scripts/checkpoint_save_cost.py --size gpt2 \\
        --strategy zero2 --checkpoint-format sharded --output-dir OUT
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import dpkit
from dpkit import models
from dpkit.data import lm as lm_data


@dataclass
class SaveCostOptions:
    checkpoint_format: str = field(default="sharded", metadata={"choices": ["sharded", "full"]})
    minilm: bool = field(default=False, metadata={"help": "MiniLM instead of --size"})


def build(workload: lm_data.LMWorkload, minilm: bool) -> torch.nn.Module:
    if minilm:
        from transformers import AutoModelForSequenceClassification

        path, _ = models.load_model_config("sentence-transformers/all-MiniLM-L6-v2")
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    return lm_data.build_lm(lm_data.lm_config(workload), workload.seed)


def main() -> None:
    workload, strategy_cfg, options = dpkit.parse_args(
        lm_data.LMWorkload, dpkit.StrategyConfig, SaveCostOptions
    )
    model = build(workload, options.minilm)
    run = dpkit.setup(
        strategy_cfg,
        model=model,
        micro_batch_size=1,
        learning_rate=1e-4,
        output_dir=workload.output_dir,
        checkpoint_format=options.checkpoint_format,
        memory_probe_steps=0,
    )
    optimizer = run.make_optimizer(
        models.adamw_param_groups(model, 0.0), lr=1e-4, weight_decay=0.0
    )
    model, optimizer = run.prepare(model, optimizer)
    tokens = torch.randint(0, 1000, (1, 32), device=run.accelerator.device)
    kwargs = {"labels": torch.zeros(1, dtype=torch.long, device=tokens.device)}
    if not options.minilm:
        kwargs = {"labels": tokens}
    run.accelerator.backward(model(input_ids=tokens, **kwargs).loss)
    optimizer.step()
    optimizer.zero_grad()
    for step in (1, 2):
        run.save_checkpoint(model, optimizer, step=step)
    run.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
