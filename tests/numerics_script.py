"""A tiny GPT-2 trained a few steps through dpkit's public API, or as a plain one-process
fp32 reference: the runs behind tests/test_numerics.py (test-only, not shipped).

    torchrun --nproc_per_node 2 tests/numerics_script.py --runs ddp:no,zero2:bf16,ddp:no:gc OUT
    python tests/numerics_script.py --reference OUT

Under dpkit the loop is a user's own accelerate loop, as the README shows it:
``dpkit.setup``, ``run.make_optimizer``, ``run.prepare`` (FSDP2's sharding, the wrapping
and the post-wrap checks), then ``accumulate``/``backward``/clip/step. ``--runs`` lists
``strategy:precision`` pairs (``strategy:precision:gc``: with gradient checkpointing), run one after the other in the same processes (start-up is
most of a tiny run's cost): the process group stays up, accelerate's singletons are reset
between runs. The reference shares nothing of that: one process, no dpkit, no accelerate,
no DeepSpeed; torch's AdamW and ``clip_grad_norm_`` on the plain model, the global batch
accumulated by hand. Both build the same model and data from the same seeds.

Writes to OUT (a run: OUT/<strategy>-<precision>[-gc]): ``losses.json`` (per optimizer
step, the loss averaged over every micro-batch of the global batch; then the trained
model's loss on the first global batch; and how often rank 0's first attention ran while
training), a run's ``run_info.json`` (``run.info``: what ``run.prepare`` checked) and
``memory_report.json`` (``run.memory``'s report, every rank) and, from the first backward, ``grads-rank<r>.pt``: FSDP2, each rank's fp32 gradient shards
(``{name: local tensor}``); the reference, the whole gradient after the micro-batches a
2-rank run's first backward covers. FSDP2 in bf16 also writes
``plain-bf16-grads-rank<r>.pt``: the rank's own unreduced gradient of the same
micro-batch on a plain bf16 copy of the model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

SEED = 0
VOCAB = 67  # odd: the tied embedding's 67 rows shard 34 + 33 under FSDP2
SEQ = 16
MICRO = 4  # sequences per micro-batch
ACCUMULATION = 2  # per rank, in the 2-rank runs
RANKS = 2
STEPS = 5
LR = 1e-2
WEIGHT_DECAY = 0.1
# The reference's gradient norms, steps 1-5: 0.75, 0.78, 1.65, 1.10, 1.20. Clipping at 1.0
# scales the last three only, so the clipping path runs (DeepSpeed's own, DTensor norms
# under FSDP2) and a gradient off by a constant factor, which Adam alone would hide,
# changes which steps are clipped: measured, a gradient doubled or halved moves the
# reference's losses by 1.1e-3 and 1.3e-3 relative.
MAX_GRAD_NORM = 1.0
LORA_R = 4  # the ``lora`` runs' adapter rank


def build_model() -> torch.nn.Module:
    """Two GPT-2 blocks, width 30 (head size 15), no dropout; the same weights every call."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=30, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(SEED)
    return GPT2LMHeadModel(config)


def token_rows() -> torch.Tensor:
    """``STEPS * RANKS * ACCUMULATION`` micro-batches of learnable sequences: each counts
    up from a random token by a random stride of 1-3, modulo the vocabulary."""
    generator = torch.Generator().manual_seed(SEED + 1)
    rows = STEPS * RANKS * ACCUMULATION * MICRO
    start = torch.randint(0, VOCAB, (rows, 1), generator=generator)
    stride = torch.randint(1, 4, (rows, 1), generator=generator)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def lora_model() -> torch.nn.Module:
    """:func:`build_model` with LoRA adapters as plain peft makes them (no dpkit): rank
    ``LORA_R`` on GPT-2's fused attention projection ``c_attn`` (a transposed ``Conv1D``),
    initialised from seed 0, which is what a dpkit run's ``--lora-r`` is asked to do."""
    from peft import LoraConfig, get_peft_model

    model = build_model()
    config = LoraConfig(
        r=LORA_R, lora_alpha=2 * LORA_R, target_modules=["c_attn"], fan_in_fan_out=True,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(0)
    return get_peft_model(model, config)


def reference(out: Path, lora: bool = False) -> None:
    """One process, fp32, plain torch: each step accumulates the global batch's
    ``RANKS * ACCUMULATION`` micro-batches, each loss divided by their count. ``lora``:
    the LoRA model of :func:`lora_model`, its trainable parameters only in the optimizer."""
    model = lora_model() if lora else build_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY)
    micro_batches = token_rows().split(MICRO)
    per_step = RANKS * ACCUMULATION
    losses = []
    model.train()
    for step in range(STEPS):
        step_losses = []
        for k, ids in enumerate(micro_batches[step * per_step : (step + 1) * per_step]):
            loss = _loss(model, ids)
            (loss / per_step).backward()
            step_losses.append(loss.item())
            if step == 0 and k == RANKS - 1 and not lora:  # a 2-rank run's first reduction
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                torch.save(grads, out / "grads-rank0.pt")
        torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses) / len(step_losses))
    model.eval()
    with torch.no_grad():
        first = micro_batches[:per_step]
        final = sum(_loss(model, ids).item() for ids in first) / len(first)
    (out / "losses.json").write_text(json.dumps({"train": losses, "final": final}))


def plain_bf16_gradient(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's own gradient of its first micro-batch, unreduced: a plain bf16 copy of
    the initial model (no FSDP, no accelerate) under torch's bf16 autocast, the loss divided
    by ``ACCUMULATION`` as ``accelerator.backward`` divides it; the bf16 gradients as fp32."""
    model = build_model().to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model, ids)
    (loss / ACCUMULATION).backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


def with_dpkit(
    out: Path, strategy: str, precision: str, checkpointing: bool = False, lora: bool = False
) -> Any:
    """A user's accelerate loop on dpkit, ``ACCUMULATION`` micro-batches per rank per step;
    returns the Accelerator (its process group still up)."""
    from torch.utils.data import DataLoader

    import dpkit

    model = build_model()
    # Calls of the first block's attention while training: a checkpointed block runs it
    # again in backward (its module hooks stay outside the checkpoint, the attention's not).
    attention_calls = [0]
    model.transformer.h[0].attn.register_forward_hook(
        lambda *_: attention_calls.__setitem__(0, attention_calls[0] + 1)
    )
    args = dpkit.StrategyConfig(
        strategy=strategy,
        mixed_precision=precision,
        gradient_checkpointing=checkpointing,
        lora_r=LORA_R if lora else None,
        lora_target_modules="c_attn" if lora else None,
    )
    run = dpkit.setup(
        args,
        model=model,
        micro_batch_size=MICRO,
        gradient_accumulation_steps=ACCUMULATION,
        max_grad_norm=MAX_GRAD_NORM,
        learning_rate=LR,
    )
    accelerator = run.accelerator
    model = run.apply_lora(model)  # with lora: the adapters; without, the model as it is
    # accelerate hands micro-batch i to rank i % N: a step's micro-batches over both ranks
    # are the reference's step's.
    loader = DataLoader(list(token_rows()), batch_size=MICRO)
    # Built over the whole parameters: run.prepare moves it onto FSDP2's shards.
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = run.make_optimizer(trainable, lr=LR, weight_decay=WEIGHT_DECAY)
    model, optimizer, loader = run.prepare(model, optimizer, loader)
    info = run.info
    assert (info.world_size, info.precision) == (RANKS, precision), info
    rank = accelerator.process_index
    losses, step_losses, first_backward = [], [], True
    model.train()
    for ids in loader:
        with accelerator.accumulate(model):
            loss = _loss(model, ids)
            accelerator.backward(loss)
            if first_backward and strategy.startswith("fsdp2") and not lora:
                # Every gradient is a DTensor shard (to_local fails on anything else).
                shards = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
                torch.save(shards, out / f"grads-rank{rank}.pt")
                if precision == "bf16":
                    torch.save(plain_bf16_gradient(ids), out / f"plain-bf16-grads-rank{rank}.pt")
            first_backward = False
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM
                )
            optimizer.step()
            optimizer.zero_grad()
        step_losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
        if accelerator.sync_gradients:
            losses.append(sum(step_losses) / len(step_losses))
            step_losses = []
    training_attention_calls = attention_calls[0]
    report = run.memory.report(step=STEPS)  # every rank's, on the main process
    model.eval()
    with torch.no_grad():
        first = token_rows().split(MICRO)[: RANKS * ACCUMULATION]
        final = sum(_loss(model, ids).item() for ids in first) / len(first)
    if accelerator.is_main_process:
        record = {"train": losses, "final": final, "attention_calls": training_attention_calls}
        (out / "losses.json").write_text(json.dumps(record))
        (out / "run_info.json").write_text(json.dumps(info.as_dict()))
        report.save(out / "memory_report.json")
    accelerator.wait_for_everyone()
    return accelerator


def _fresh_accelerate_state() -> None:
    """Forget the finished run's Accelerator (its strategy, precision and accumulation are
    singletons in accelerate); the process group stays up for the next run."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main(argv: list[str]) -> None:
    out = Path(argv[-1])
    out.mkdir(parents=True, exist_ok=True)
    if "--reference" in argv:
        reference(out)
        return
    # strategy:precision, or strategy:precision:gc (gradient checkpointing) or :lora
    runs = [pair.split(":") for pair in argv[argv.index("--runs") + 1].split(",")]
    for index, (strategy, precision, *lever) in enumerate(runs):
        environ = dict(os.environ)  # what dpkit and accelerate set for this run goes after it
        folder = out / "-".join([strategy, precision, *lever])
        folder.mkdir(exist_ok=True)
        accelerator = with_dpkit(
            folder, strategy, precision, checkpointing=lever == ["gc"], lora=lever == ["lora"]
        )
        if index == len(runs) - 1:
            accelerator.end_training()  # destroys the process group
            break
        # Not end_training between runs: a process group destroyed and formed again on the
        # same rendezvous port hung, or failed with "Connection refused" (measured).
        _fresh_accelerate_state()
        os.environ.clear()
        os.environ.update(environ)


if __name__ == "__main__":
    main(sys.argv[1:])
