"""Every multi-rank numeric path against one fp32 process: DDP, ZeRO-1, ZeRO-2 and FSDP2's two
modes, in fp32 and bf16, on 2 CPU processes.

One ``torchrun`` launch of tests/numerics_script.py trains a tiny GPT-2 (2 blocks, width 30,
vocabulary 67: FSDP2's shards are uneven) 5 steps under each of the ten (strategy,
precision) pairs in turn, through dpkit's public API as a user's own accelerate loop does
(``dpkit.setup``, ``run.prepare``, ``accumulate``, clipping): 2 ranks x
micro-batch 4 x accumulation 2. The reference is the same model and data in ONE process,
fp32, plain torch (no dpkit, accelerate or DeepSpeed): each step accumulates the same
global batch of 4 micro-batches by hand, same seed, no dropout. Checked:

* every run's losses (5 steps, then the trained model's loss on the first global batch)
  against the reference: within fp32 rounding in fp32, within bf16 rounding in bf16, and
  the bf16 runs measurably not fp32;
* FSDP2's reduce-scattered gradient shards after the first backward: in fp32 the
  reference's gradient; in bf16 exactly the fp32 mean of the two ranks' own bf16
  gradients (computed by the script on a plain unsharded bf16 copy of the model), which
  a reduction in bf16 would round back to bf16.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.harness import max_rel_diff, run, torchrun_cmd

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/numerics_script.py"
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2_shard_grad_op", "fsdp2_full_shard")
FSDP2_MODES = ("fsdp2_shard_grad_op", "fsdp2_full_shard")
RUNS = [(strategy, precision) for precision in ("no", "bf16") for strategy in STRATEGIES]
# With gradient checkpointing: every strategy in fp32, and one in bf16 (16-bit weights).
CHECKPOINTED = [*((strategy, "no") for strategy in STRATEGIES), ("fsdp2_full_shard", "bf16")]
# With LoRA (rank 4 on c_attn, tests/numerics_script.py): every strategy in fp32, and bf16
# under ZeRO-2 (the whole module cast to bf16, frozen weights too) and FSDP2 full-shard.
LORA = STRATEGIES
LORA_BF16 = ("zero2", "fsdp2_full_shard")
# The offloads, in the same launch: fp32 and bf16, fp32 checkpointed, fp32 LoRA (their
# optimizer steps in host memory: DeepSpeed's CPU Adam in AdamW mode, torch's AdamW on
# FSDP2's host shards).
OFFLOADS = ("zero2_offload", "zero3_offload", "fsdp2_full_shard_offload")

# fp32 losses against the fp32 reference. Measured: every strategy within 8.6e-8 relative
# at every point (the rounding of a mean of four fp32 losses; the 2-rank sum against the
# one-process accumulation, fused against foreach AdamW, one thread against two). Adam
# would amplify a reduction-order difference over many steps (the bare stack's DDP and
# DeepSpeed drift apart by 3e-4 by step 6 on a 23M model with dropout), which these 5
# steps do not show. 1e-5 leaves 100x; it still fails a run whose gradients are
# off by a constant factor (1.1e-3, see MAX_GRAD_NORM in the script) and an "fp32"
# run that computed in bf16 (1.7e-3 at least, the bf16 runs below).
FP32_RTOL = 1e-5
# bf16 losses against the fp32 reference: bf16 keeps 8 significant bits (relative spacing
# 2^-8 to 2^-7); each forward and backward rounds every activation (DeepSpeed: the module
# itself) and the differences compound through Adam's steps. Measured, worst point per
# run (growing from 5e-6 at step 1): DDP 1.66e-3, ZeRO-1 1.89e-3, ZeRO-2 1.95e-3, FSDP2
# both modes 1.76e-3. 2^-7 = 7.8e-3 is 4x the worst; the trajectory moves 17%.
BF16_RTOL = 2.0**-7
# And a bf16 run must differ from fp32 by more than fp32 rounding (measured at least
# 1.66e-3, against 8.6e-8 in fp32): a run that silently stayed fp32 fails here.
BF16_MIN_DEVIATION = 1e-5
# FSDP2's fp32 gradient shards, reassembled, against the reference's gradient: measured
# within 4.1e-7 of each tensor's largest element (a LayerNorm bias: fp32 sums over every
# position, in another order).
GRAD_FP32_RTOL = 1e-5
# FSDP2's bf16 gradient shards against the fp32 mean of the two ranks' own bf16 gradients:
# measured bit for bit equal (a sum of two bf16 numbers is exact in fp32 unless their
# exponents are 16 apart). Bound: a few fp32 roundings of the operands' magnitude, 2^-22;
# a reduction in bf16 rounds the sum to 8 bits, an error up to 2^-9 of it.
GRAD_BF16_EXACT_RTOL = 2.0**-22
# A mean of two bf16 numbers reduced in fp32 is often not a bf16 number (it needs one more
# significant bit, more when the exponents differ): measured 13,706 of the 24,930
# gradient elements (55%); reduced in bf16 every element is one (measured 0).
MIN_NOT_BF16_FRACTION = 0.25
# The ranks' bf16 gradient (their fp32 mean) against the fp32 reference's: bf16 rounding
# through two blocks' forward and backward, measured at most 1.54e-2 of a tensor's norm
# (LayerNorm's parameters: sums over every position, with cancellation). 2^-4 = 6.25e-2
# is 4x; a gradient not averaged over the ranks is 100% off.
GRAD_BF16_VS_FP32_RTOL = 2.0**-4


@dataclass
class Runs:
    root: Path
    reference: Path
    lora_reference: Path

    def folder(
        self, strategy: str, precision: str, checkpointed: bool = False, lora: bool = False
    ) -> Path:
        lever = "-gc" if checkpointed else "-lora" if lora else ""
        return self.root / f"{strategy}-{precision}{lever}"

    def losses(
        self, strategy: str, precision: str, checkpointed: bool = False, lora: bool = False
    ) -> list[float]:
        return _trajectory(self.folder(strategy, precision, checkpointed, lora))

    def reference_losses(self) -> list[float]:
        return _trajectory(self.reference)


def _trajectory(folder: Path) -> list[float]:
    """The 5 training losses, then the trained model's loss on the first global batch."""
    record = json.loads((folder / "losses.json").read_text())
    return [*record["train"], record["final"]]


@pytest.fixture(scope="module")
def numerics(module_tmp) -> Runs:
    """The ten 2-rank runs in one launch (measured: 24 CPU-seconds for torchrun and both
    ranks, most of it their start-up; 49-54 s of wall time on 2 cores that other jobs
    kept at a load of 8-11), and the one-process reference in this process, on one
    thread (0.2 CPU-seconds; two threads on a loaded machine spun for 3)."""
    from tests import numerics_script

    root = module_tmp / "runs"
    pairs = ",".join(
        [f"{strategy}:{precision}" for strategy, precision in RUNS]
        + [f"{strategy}:{precision}:gc" for strategy, precision in CHECKPOINTED]
        + [f"{strategy}:no:lora" for strategy in LORA]
        + [f"{strategy}:bf16:lora" for strategy in LORA_BF16]
        + [f"{strategy}:{precision}" for precision in ("no", "bf16") for strategy in OFFLOADS]
        + [f"{strategy}:no:{lever}" for lever in ("gc", "lora") for strategy in OFFLOADS]
    )
    started = time.monotonic()
    run(torchrun_cmd(2, "--runs", pairs, str(root), recipe=SCRIPT), root).check()
    print(f"numerics launch: {time.monotonic() - started:.1f} s")
    reference = module_tmp / "reference"
    lora_reference = module_tmp / "lora-reference"
    reference.mkdir()
    lora_reference.mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            numerics_script.reference(reference)
            numerics_script.reference(lora_reference, lora=True)
    finally:
        torch.set_num_threads(threads)
    return Runs(root, reference, lora_reference)


def _moves(reference: list[float], tolerance: float) -> None:
    """The control: the reference trajectory moves far more than the tolerance, so an
    agreement cannot come from a model that does not train."""
    spread = (max(reference) - min(reference)) / max(reference)
    assert spread > 10 * tolerance, (spread, reference)


@pytest.mark.parametrize(("strategy", "precision"), RUNS)
def test_each_run_is_the_two_rank_job_it_names(numerics, strategy, precision):
    info = json.loads((numerics.folder(strategy, precision) / "run_info.json").read_text())
    assert (info["strategy"], info["precision"]) == (strategy, precision)
    assert (info["world_size"], info["backend"]) == (2, "gloo")
    assert (info["micro_batch_size"], info["gradient_accumulation_steps"]) == (4, 2)
    assert info["global_batch_size"] == 16  # the reference's 4 micro-batches of 4
    deepspeed, fsdp2 = "DeepSpeedEngine+DeepSpeedZeroOptimizer", "FSDP2 fully_shard (3 units)+AdamW"
    wrapper, stage = {
        "ddp": ("DistributedDataParallel", 0),
        "zero1": (deepspeed, 1),
        "zero2": (deepspeed, 2),
        "zero3": ("DeepSpeedEngine+DeepSpeedZeroOptimizer_Stage3", 3),
        "fsdp2_shard_grad_op": (fsdp2, 2),  # two GPT2Blocks, then the root
        "fsdp2_full_shard": (fsdp2, 3),
    }[strategy]
    assert (info["wrapper"], info["zero_stage"]) == (wrapper, stage)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp32_runs_match_one_fp32_process(numerics, strategy):
    reference = numerics.reference_losses()
    losses = numerics.losses(strategy, "no")
    assert max_rel_diff(losses, reference, length=6) <= FP32_RTOL, (losses, reference)
    _moves(reference, FP32_RTOL)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_runs_stay_within_bf16_rounding_of_one_fp32_process(numerics, strategy):
    reference = numerics.reference_losses()
    losses = numerics.losses(strategy, "bf16")
    deviation = max_rel_diff(losses, reference, length=6)
    assert BF16_MIN_DEVIATION < deviation <= BF16_RTOL, (deviation, losses, reference)
    _moves(reference, BF16_RTOL)


def _reassembled(folder: Path) -> dict[str, torch.Tensor]:
    """Each parameter's gradient from the two ranks' dim-0 shards (FSDP2 gives rank 0 the
    first ceil(n/2) rows)."""
    ranks = [torch.load(folder / f"grads-rank{r}.pt") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    return {name: torch.cat([ranks[0][name], ranks[1][name]]) for name in ranks[0]}


def _reference_gradient(numerics: Runs) -> dict[str, torch.Tensor]:
    """The reference's gradient after the two micro-batches the ranks' first backward
    covers (each loss divided by the 4 of the step)."""
    return torch.load(numerics.reference / "grads-rank0.pt")


@pytest.mark.parametrize("mode", FSDP2_MODES)
def test_fsdp2_gradient_shards_are_the_reference_gradient(numerics, mode):
    shards = _reassembled(numerics.folder(mode, "no"))
    reference = _reference_gradient(numerics)
    assert shards.keys() == reference.keys()
    # The tied embedding's 67 rows shard 34 + 33.
    assert torch.load(numerics.folder(mode, "no") / "grads-rank1.pt")[
        "transformer.wte.weight"
    ].shape == (33, 30)
    for name, expected in reference.items():
        assert shards[name].shape == expected.shape, name
        scale = expected.abs().max()
        assert scale > 0, name  # the control: every parameter gets a gradient
        error = (shards[name] - expected).abs().max() / scale
        assert error <= GRAD_FP32_RTOL, (name, error.item())


@pytest.mark.parametrize("mode", FSDP2_MODES)
def test_fsdp2_reduces_bf16_gradients_in_fp32(numerics, mode):
    folder = numerics.folder(mode, "bf16")
    shards = _reassembled(folder)
    local = [torch.load(folder / f"plain-bf16-grads-rank{r}.pt") for r in (0, 1)]
    assert shards.keys() == local[0].keys()
    not_bf16 = total = 0
    for name, reduced in shards.items():
        # The value: the fp32 mean of the ranks' bf16 gradients, unrounded.
        mean = (local[0][name] + local[1][name]) / 2
        magnitude = (local[0][name].abs() + local[1][name].abs()) / 2
        excess = (reduced - mean).abs() - GRAD_BF16_EXACT_RTOL * magnitude
        assert excess.max() <= 0, (name, (reduced - mean).abs().max().item())
        not_bf16 += (reduced != reduced.to(torch.bfloat16).float()).sum().item()
        total += reduced.numel()
    # Independent of the plain copy: many reduced elements need more than bf16's 8 bits.
    assert not_bf16 > MIN_NOT_BF16_FRACTION * total, (not_bf16, total)
    # The control: the ranks' own gradients are this model's gradient, bf16-rounded.
    reference = _reference_gradient(numerics)
    for name, expected in reference.items():
        mean = (local[0][name] + local[1][name]) / 2
        error = (mean - expected).norm() / expected.norm()
        assert error <= GRAD_BF16_VS_FP32_RTOL, (name, error.item())


# ---- gradient checkpointing ------------------------------------------------------------------

# Per rank: 5 optimizer steps x 2 micro-batches = 10 training forwards of the first block's
# attention; checkpointed, the block runs it again in backward (its module hooks stay
# outside the checkpoint, the attention's inside it).
TRAINING_FORWARDS = 5 * 2
# Checkpointed, the forward keeps each block's input and what lies outside the blocks;
# measured 49,540 of 498,052 bytes per rank in fp32 (0.099), 33,924 of 258,692 in bf16
# (0.131). At 0.25 a run that kept half of one block's saved tensors fails.
MAX_CHECKPOINTED_SHARE = 0.25
ACTIVATION_TOLERANCE_PCT = 15  # docs/plan.md, "Checked against real runs"


@pytest.mark.parametrize(("strategy", "precision"), CHECKPOINTED)
def test_checkpointed_runs_recompute_and_match_one_fp32_process(numerics, strategy, precision):
    folder = numerics.folder(strategy, precision, checkpointed=True)
    info = json.loads((folder / "run_info.json").read_text())
    assert (info["strategy"], info["precision"], info["world_size"]) == (strategy, precision, 2)
    assert info["gradient_checkpointing"] is True
    plain_info = json.loads((numerics.folder(strategy, precision) / "run_info.json").read_text())
    assert plain_info["gradient_checkpointing"] is False
    # The same arithmetic, recomputed: the tolerance of the uncheckpointed runs (measured:
    # DDP's losses bit for bit its uncheckpointed run's; the rest within fp32 rounding).
    reference = numerics.reference_losses()
    losses = numerics.losses(strategy, precision, checkpointed=True)
    tolerance = FP32_RTOL if precision == "no" else BF16_RTOL
    assert max_rel_diff(losses, reference, length=6) <= tolerance, (losses, reference)
    calls = json.loads((folder / "losses.json").read_text())["attention_calls"]
    plain = json.loads((numerics.folder(strategy, precision) / "losses.json").read_text())
    assert (calls, plain["attention_calls"]) == (2 * TRAINING_FORWARDS, TRAINING_FORWARDS)


@pytest.mark.parametrize(("strategy", "precision"), CHECKPOINTED)
def test_checkpointing_keeps_the_layer_inputs_only_as_planned(numerics, strategy, precision):
    from dpkit.plan.check import check_run

    folder = numerics.folder(strategy, precision, checkpointed=True)
    report = json.loads((folder / "memory_report.json").read_text())
    plain = json.loads((numerics.folder(strategy, precision) / "memory_report.json").read_text())
    assert (report["gradient_checkpointing"], plain["gradient_checkpointing"]) == (True, False)
    kept = max(r["activations"] for r in report["ranks"])
    full = max(r["activations"] for r in plain["ranks"])
    assert 0 < kept < MAX_CHECKPOINTED_SHARE * full, (kept, full)
    # dpkit plan --against: planned checkpointed (a trace of the checkpointed model), within
    # the documented tolerance of what the run measured.
    check = check_run(folder)
    assert check.gradient_checkpointing and check.activation_method == "trace"
    assert abs(check.error_pct["activations"]) <= ACTIVATION_TOLERANCE_PCT, check.error_pct
    assert check.recomputed_layer > 0  # the recomputed block: planned, in the peak only


# ---- LoRA ------------------------------------------------------------------------------------

# The adapters: rank 4 on each block's c_attn (a Conv1D from width 30 to 90), A is 4 x 30
# and B is 90 x 4: 2 blocks x (120 + 360) parameters train.
LORA_TRAINABLE = 2 * (4 * 30 + 90 * 4)
# fp32 tolerances as above; a state figure within 1% (the optimizer's scalar step tensors).
STATE_RTOL = 0.01


def _lora_info(numerics: Runs, strategy: str, precision: str = "no") -> tuple[dict, dict]:
    folder = numerics.folder(strategy, precision, lora=True)
    info = json.loads((folder / "run_info.json").read_text())
    report = json.loads((folder / "memory_report.json").read_text())
    return info, report


@pytest.mark.parametrize("strategy", LORA)
def test_lora_runs_match_one_plain_peft_process(numerics, strategy):
    """The adapters train as plain peft trains them in one process (its own LoraConfig,
    seed 0), the pretrained weights frozen, under every strategy."""
    info, _ = _lora_info(numerics, strategy)
    assert (info["strategy"], info["world_size"], info["backend"]) == (strategy, 2, "gloo")
    assert info["lora"]["r"] == 4 and info["lora"]["target_modules"] == ["c_attn"]
    reference = _trajectory(numerics.lora_reference)
    losses = numerics.losses(strategy, "no", lora=True)
    assert max_rel_diff(losses, reference, length=6) <= FP32_RTOL, (losses, reference)
    _moves(reference, FP32_RTOL)
    # The control: training every weight is another trajectory.
    assert max_rel_diff(numerics.reference_losses(), reference, length=6) > 100 * FP32_RTOL


@pytest.mark.parametrize("strategy", LORA)
def test_lora_runs_hold_gradients_and_moments_for_the_adapters_only(numerics, strategy):
    from tests import numerics_script

    info, report = _lora_info(numerics, strategy)
    everything = numerics_script.lora_model()  # plain peft, counted here
    shapes = [tuple(p.shape) for p in everything.parameters()]
    total = sum(p.numel() for p in everything.parameters())
    assert info["num_params"] == LORA_TRAINABLE
    assert info["frozen_params"] == total - LORA_TRAINABLE == report["frozen_params"]
    sharded = strategy != "ddp"
    if strategy.startswith("fsdp2"):
        # fully_shard gives rank 0 the first ceil(rows / 2) rows of every parameter.
        rows = [
            -(-shape[0] // 2) * (math.prod(shape[1:]) if len(shape) > 1 else 1) for shape in shapes
        ]
        params = 4 * sum(rows)
    elif strategy == "zero3":
        # Each parameter's own slice, frozen ones too: ceil(numel / 2) elements (DeepSpeed
        # pads every parameter to a multiple of the world size). Every tensor of this model
        # is under the 1e5-element persistence threshold: each rank also keeps them whole,
        # a buffer beside the slice.
        params = 4 * sum(-(-math.prod(shape) // 2) for shape in shapes)
        assert max(r["buffers_total"] for r in report["ranks"]) >= 4 * total
    else:  # DDP and ZeRO-1/2 keep the whole fp32 module on each rank
        params = 4 * total
    expected = {
        "params": params,
        "optimizer": 8 * LORA_TRAINABLE / (2 if sharded else 1),  # Adam's two moments
        "master": 4 * LORA_TRAINABLE / 2 if strategy in ("zero1", "zero2", "zero3") else 0,
    }
    if strategy == "ddp" or strategy in FSDP2_MODES:  # the adapters' fp32 gradient (shard)
        expected["grads"] = 4 * LORA_TRAINABLE / (2 if sharded else 1)
    measured = {k: max(r[k] for r in report["ranks"]) for k in expected}
    for category, value in expected.items():
        assert value * (1 - STATE_RTOL) <= measured[category] <= value * (1 + STATE_RTOL) + 64, (
            category,
            measured[category],
            value,
        )
    # ZeRO: gradients for the adapters only, at most their whole fp32 gradient and one
    # copy (the step flattens its partition); the token embedding alone is 67 x 30 x 4 =
    # 8,040 bytes.
    grads = max(r["grads"] for r in report["ranks"])
    assert 0 < grads <= 2 * 4 * LORA_TRAINABLE, grads
    # The report's own prediction and dpkit plan --against agree with the run.
    from dpkit.plan.check import check_run

    check = check_run(numerics.folder(strategy, "no", lora=True))
    for category in ("params", "optimizer", "total"):
        assert abs(check.error_pct[category]) <= 100 * STATE_RTOL, check.error_pct
    assert abs(check.error_pct["activations"]) <= ACTIVATION_TOLERANCE_PCT, check.error_pct


@pytest.mark.parametrize("strategy", LORA_BF16)
def test_bf16_lora_runs_stay_within_bf16_rounding_and_keep_fp32_moments(numerics, strategy):
    info, report = _lora_info(numerics, strategy, "bf16")
    assert (info["precision"], info["num_params"]) == ("bf16", LORA_TRAINABLE)
    reference = _trajectory(numerics.lora_reference)
    losses = numerics.losses(strategy, "bf16", lora=True)
    deviation = max_rel_diff(losses, reference, length=6)
    assert BF16_MIN_DEVIATION < deviation <= BF16_RTOL, (deviation, losses, reference)
    total = LORA_TRAINABLE + info["frozen_params"]
    measured = {k: max(r[k] for r in report["ranks"]) for k in ("params", "optimizer")}
    # Adam's fp32 moments for the adapters only, over 2 ranks; ZeRO-2 holds the whole
    # module in bf16 (frozen weights too), FSDP2 fp32 shards (bf16 only while computing).
    assert measured["optimizer"] == pytest.approx(8 * LORA_TRAINABLE / 2, rel=STATE_RTOL)
    if strategy == "zero2":
        assert measured["params"] == 2 * total
    else:
        assert 4 * total / 2 <= measured["params"] <= 4 * total / 2 + 4 * 30 * 4


# ---- offload -----------------------------------------------------------------------------

# DeepSpeed's CPU Adam rounds its update otherwise than torch's fused AdamW: measured
# against the fp32 reference, ZeRO-2 offload 3.8e-7, ZeRO-3 offload 4.3e-7 (checkpointed
# the same), FSDP2 offload 5.6e-8 (torch's AdamW), LoRA 5.6e-8 each; bf16 1.8e-3 to 2.0e-3.
# The fp32 and bf16 tolerances above hold (26x and 4x).


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("strategy", OFFLOADS)
def test_offload_runs_are_the_jobs_they_name_and_match_one_fp32_process(
    numerics, strategy, precision
):
    info = json.loads((numerics.folder(strategy, precision) / "run_info.json").read_text())
    assert (info["strategy"], info["precision"], info["world_size"]) == (strategy, precision, 2)
    assert info["offload_optimizer"] == "cpu"
    wrapper, stage = {
        "zero2_offload": ("DeepSpeedEngine+DeepSpeedZeroOptimizer", 2),
        "zero3_offload": ("DeepSpeedEngine+DeepSpeedZeroOptimizer_Stage3", 3),
        "fsdp2_full_shard_offload": ("FSDP2 fully_shard (3 units)+AdamW", 3),
    }[strategy]
    assert (info["wrapper"], info["zero_stage"]) == (wrapper, stage)
    reference = numerics.reference_losses()
    deviation = max_rel_diff(numerics.losses(strategy, precision), reference, length=6)
    if precision == "no":
        assert deviation <= FP32_RTOL, deviation
    else:
        assert BF16_MIN_DEVIATION < deviation <= BF16_RTOL, deviation


@pytest.mark.parametrize("strategy", OFFLOADS)
def test_offload_checkpointed_runs_recompute_and_match_one_fp32_process(numerics, strategy):
    folder = numerics.folder(strategy, "no", checkpointed=True)
    info = json.loads((folder / "run_info.json").read_text())
    assert (info["strategy"], info["gradient_checkpointing"]) == (strategy, True)
    losses = numerics.losses(strategy, "no", checkpointed=True)
    reference = numerics.reference_losses()
    assert max_rel_diff(losses, reference, length=6) <= FP32_RTOL, (losses, reference)
    calls = json.loads((folder / "losses.json").read_text())["attention_calls"]
    assert calls == 2 * TRAINING_FORWARDS  # each block's attention run again in backward


@pytest.mark.parametrize("strategy", OFFLOADS)
def test_offload_lora_trains_the_adapters_with_their_moments_in_host_memory(numerics, strategy):
    """LoRA under offload: the adapters train as plain peft trains them, and Adam's two
    fp32 moments of the adapters only (8 bytes x 960 / 2 ranks) are in host memory, none
    on the device."""
    info, report = _lora_info(numerics, strategy)
    assert (info["strategy"], info["num_params"]) == (strategy, LORA_TRAINABLE)
    reference = _trajectory(numerics.lora_reference)
    losses = numerics.losses(strategy, "no", lora=True)
    assert max_rel_diff(losses, reference, length=6) <= FP32_RTOL, (losses, reference)
    expected = 8 * LORA_TRAINABLE / 2
    for row in report["ranks"]:
        assert row["optimizer"] == row["master"] == 0, row
        host = row["host"]["optimizer"]
        assert expected * (1 - STATE_RTOL) <= host <= expected * (1 + STATE_RTOL) + 64, host
