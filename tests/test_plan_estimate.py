"""``dpkit plan``'s per-strategy estimate, micro-batch search and recommendation, in process.

Figures worked by hand for a bare count of 10^9 parameters on 8 GPUs, bf16 AdamW, no
reserve or headroom (so the totals are the arithmetic alone), per GPU:

* DDP: fp32 parameters, gradients and moments, 4 + 4 + 8 bytes, and autocast's 16-bit
  weight copies, 2: 18 GB.
* ZeRO-1: bf16 module 2; 16-bit gradients whole, 2 (their fp32 cast, 6/8, is smaller);
  moments 8/8; master 4/8; DeepSpeed's default reduce bucket (5e8 elements, 2 B) 1; the
  step's flat 16-bit copy of the partition, 2/8: 2 + 1 + 0.5 + 1 + 2 + 0.25 = 6.75 GB.
* ZeRO-2: the gradient partition and its cast 6/8 instead: 2 + 1 + 0.5 + 1 + 0.75 + 0.25 =
  5.5 GB.
* FSDP2 shard-grad-op: 16/8 of states and every parameter whole in bf16, 2: 4 GB;
  full-shard: 2 GB (a count has no layers to hold whole).
* ZeRO-2 offload: the bf16 module 2, its 16-bit gradient partition 2/8, the bucket 1:
  3.25 GB; the host 8/8 + 4/8 + the fp32 gradient partition 4/8 = 2 GB per GPU.
* ZeRO-3: 2/8 + its gradient partition and the step's fp32 copy (2 + 4)/8 + 8/8 + 4/8, the
  bucket 1, and the parameters gathered at the end of the forward: every one of the 10^9,
  as DeepSpeed's default reuse distance (10^9 elements) covers them all, 2 B each, 2:
  0.25 + 0.75 + 1 + 0.5 + 1 + 2 = 5.5 GB.
* ZeRO-3 offload: no model state on the device, ZeRO-3's bucket 1 and gathered parameters
  2: 3 GB; the host the bf16 partition 2/8, its gradients and the masters' fp32 ones
  (2 + 4)/8, moments 8/8, master 4/8: 0.25 + 0.75 + 1 + 0.5 = 2.5 GB per GPU.
* FSDP2 full-shard offload: a count has no layers, so the whole model gathered in bf16 on
  the device, 2 GB (a bound); the host the fp32 parameter and gradient shards 4/8 + 4/8
  and the moments 8/8: 2 GB per GPU.

Every plan here is given 1 TB of host memory per node (``--host-memory``), so that none
depends on the machine's.
"""

from __future__ import annotations

import pytest

from dpkit.core.spec import ModelSpec, PlanInputs
from dpkit.core.units import format_gib
from dpkit.engines import engine_of
from dpkit.errors import UsageError
from dpkit.plan import estimate as plan
from dpkit.plan import inputs as plan_inputs
from dpkit.plan.activations import ActivationProfile
from dpkit.plan.recommend import Plan, make_plan

GB = 10**9
PSI = 10**9
BY_HAND = {
    "ddp": 18 * GB, "zero1": 6.75 * GB, "zero2": 5.5 * GB, "fsdp2_shard_grad_op": 4 * GB,
    "fsdp2_full_shard": 2 * GB, "zero2_offload": 3.25 * GB, "zero3": 5.5 * GB,
    "zero3_offload": 3 * GB, "fsdp2_full_shard_offload": 2 * GB,
}  # fmt: skip
COUNT = ModelSpec(name="1B", source="count", num_params=PSI)
GATHERED_BY_HAND = 2 * GB  # ZeRO-3's gathered parameters, from the docstring's arithmetic


def _count_inputs(**overrides) -> PlanInputs:
    settings = {"reserve": 0, "headroom": 0.0, "host_memory": 1000 * GB} | overrides
    return PlanInputs(model=COUNT, **settings)


def test_every_row_of_a_count_by_hand():
    result = make_plan(_count_inputs(gpu_memory=100 * GB))
    assert {r.strategy: r.total for r in result.rows} == BY_HAND
    offload = result.row("zero2_offload")
    # Host per GPU, N = 8: fp32 gradient partition 4/8, Adam state 8/8, master 4/8 bytes a
    # parameter; buffers: the partition's bf16 copy 2/8 (a bare count has no largest
    # parameter to stage).
    assert offload.host == {
        "grads": 0.5 * GB, "optimizer": 1 * GB, "master": 0.5 * GB, "buffers": 0.25 * GB,
    }  # fmt: skip
    assert offload.host_offload == 2.25 * GB
    assert result.row("zero3_offload").host == {
        "params": 0.25 * GB, "grads": 0.75 * GB, "optimizer": 1 * GB, "master": 0.5 * GB,
        "buffers": 0,
    }  # fmt: skip
    assert result.row("fsdp2_full_shard_offload").host == {
        "params": 0.5 * GB, "grads": 0.5 * GB, "optimizer": 1 * GB,
    }  # fmt: skip
    assert (offload.optimizer, offload.master, offload.step_parts) == (0, 0, {})
    zero3 = result.row("zero3")
    assert zero3.buffer_parts == {
        "reduce_bucket": 1 * GB, "gathered_params": GATHERED_BY_HAND,
        "persistent_small_tensors": 0,
    }  # fmt: skip
    assert zero3.step_parts == {}  # its fp32 gradient copy is among the gradients
    assert result.row("zero1").step_parts == {"flat_grad_partition": 0.25 * GB}
    assert result.row("ddp").buffer_parts == {"ddp_gradient_buckets": 0}
    assert set(result.largest_micro_batches.values()) == {None}  # no activations


@pytest.mark.parametrize(
    ("gpu_gb", "chosen", "reason"),
    [
        (20, "ddp",
         "DDP fits (16.8 GiB of 18.6 GiB usable): nothing needs sharding, and ZeRO would add a "
         "DeepSpeed engine and sharded checkpoints for memory that is not needed."),
        (10, "zero1",
         "DDP needs 16.8 GiB, over the 9.3 GiB usable per GPU. ZeRO-1 shards optimizer state "
         "and master weights 8 ways at DDP's communication volume (ZeRO paper: 2x parameters "
         "per step): the least sharding that fits."),
        (6, "zero2",
         "DDP needs 16.8 GiB; ZeRO-1 needs 6.3 GiB, over the 5.6 GiB usable per GPU. ZeRO-2 "
         "also shards gradients 8 ways (reduce-scatter during backward, still DDP's volume): "
         "the least sharding that fits."),
        (5, "fsdp2_shard_grad_op",
         "DDP needs 16.8 GiB; ZeRO-1 needs 6.3 GiB; ZeRO-2 needs 5.1 GiB; ZeRO-3 needs 5.1 "
         "GiB, over the 4.7 GiB usable per GPU. FSDP2 shard-grad-op shards parameters, gradients and optimizer "
         "state 8 ways between steps and keeps each layer's parameters whole from its forward "
         "to its backward (torch fully_shard: an all-gather and a reduce-scatter per step, "
         "DDP's volume; no DeepSpeed engine): the least sharding dpkit runs that fits."),
        (3, "fsdp2_full_shard",
         "DDP needs 16.8 GiB; ZeRO-1 needs 6.3 GiB; ZeRO-2 needs 5.1 GiB; ZeRO-3 needs 5.1 "
         "GiB; FSDP2 shard-grad-op needs 3.7 GiB, over the 2.8 GiB usable per GPU. FSDP2 full-shard also frees each "
         "layer's whole parameters after its forward and all-gathers them again in backward "
         "(1.5x DDP's communication), holding about two layers whole at a time: the least "
         "sharding dpkit runs that fits."),
    ],
)  # fmt: skip
def test_the_least_sharding_that_fits_and_why(gpu_gb, chosen, reason):
    result = make_plan(_count_inputs(gpu_memory=gpu_gb * GB))
    assert result.recommended == chosen
    assert result.reason == reason
    assert result.fits(result.row(chosen))
    # Exactly at the usable memory still fits; a byte less does not.
    edge = make_plan(_count_inputs(gpu_memory=int(BY_HAND[chosen])))
    assert edge.recommended == chosen
    assert not edge.fits(edge.row("ddp")) or chosen == "ddp"


def test_a_plan_exactly_at_a_strategys_total_picks_it_and_one_byte_less_does_not():
    at = make_plan(_count_inputs(gpu_memory=int(BY_HAND["zero2"])))
    assert at.recommended == "zero2"
    assert at.fits(at.row("zero2"))  # the table's "fits" column says the same
    below = make_plan(_count_inputs(gpu_memory=int(BY_HAND["zero2"]) - 1))
    assert below.recommended == "fsdp2_shard_grad_op"


def test_cpu_adam_runs_only_offloaded_and_says_so():
    result = make_plan(_count_inputs(gpu_memory=100 * GB, optimizer="cpu_adam"))
    assert result.recommended == "zero2_offload"
    assert [r.strategy for r in result.rows if not r.applicable] == [
        "ddp", "zero1", "zero2", "zero3", "fsdp2_shard_grad_op", "fsdp2_full_shard",
        "fsdp2_full_shard_offload",
    ]  # fmt: skip
    assert result.reason == (
        "--optimizer cpu_adam runs only with optimizer offload. Offload keeps ZeRO-2's "
        "sharding and moves optimizer state, master weights and fp32 gradients to host memory "
        "(2.1 GiB per GPU, 16.8 GiB per node); the optimizer step runs on the CPU and "
        "gradients and weights cross PCIe every step, so steps slow down."
    )
    assert result.largest_micro_batches["ddp"] is None


def test_an_offload_the_host_cannot_hold_does_not_fit():
    """--optimizer cpu_adam runs only under DeepSpeed's offloads, whose host needs per GPU
    are 2.25 GB (ZeRO-2) and 2.5 GB (ZeRO-3) (the docstring). 16 GB of host memory over 8
    GPUs is 2 GB each: neither fits, and the error names the host (2.5e9 B = 2.3 GiB,
    2e9 B = 1.9 GiB, 16e9 B = 14.9 GiB). 19.2 GB (2.4 GB each) holds ZeRO-2 offload only."""
    with pytest.raises(UsageError) as refused:
        make_plan(_count_inputs(gpu_memory=100 * GB, optimizer="cpu_adam", host_memory=16 * GB))
    assert (
        "ZeRO-3 offload fits the GPU but keeps 2.3 GiB per GPU in host memory, over the "
        "1.9 GiB usable per GPU (14.9 GiB per node, --host-memory"
    ) in str(refused.value)
    host = int(19.2 * GB)
    result = make_plan(_count_inputs(gpu_memory=100 * GB, optimizer="cpu_adam", host_memory=host))
    assert result.recommended == "zero2_offload"
    assert not result.fits(result.row("zero3_offload"))


def test_one_gpu_that_only_offload_fits_is_told_what_did_not_fit():
    """One GPU (N = 1: sharding saves nothing, full-shard 16 bytes per parameter) of 5 GB:
    only offload fits, with AdamW, so the reason lists what did not fit (DDP's 18 GB is
    16.8 GiB), not the cpu_adam rule."""
    result = make_plan(_count_inputs(gpus_per_node=1, gpu_memory=5 * GB))
    assert result.recommended == "zero2_offload"
    assert result.row("fsdp2_full_shard").total == 16 * PSI
    assert result.reason.startswith("DDP needs 16.8 GiB; ZeRO-1 needs ")
    assert "cpu_adam" not in result.reason


def test_offload_adam_becomes_cpu_adam_and_sgd_stays_sgd():
    """Offloaded, DeepSpeed swaps AdamW for its CPU Adam (the same 8 bytes of state, on the
    host); SGD runs on the CPU as itself (no state): only the master (4/8) and the fp32
    gradient partition (4/8) are on the host then, each beside the partition's bf16 copy
    (2/8)."""
    settings = plan.buffer_settings(COUNT, 8)
    hosts = (("adamw", 2.25 * GB), ("sgd", 1.25 * GB), ("sgd_momentum", 1.75 * GB))
    for optimizer, host in hosts:
        row = plan.estimate(_count_inputs(optimizer=optimizer), "zero2_offload", 1, None, settings)
        assert (row.applicable, row.host_offload) == (True, host), optimizer


def test_nothing_fits_before_activations_names_the_count_and_the_smallest_need():
    with pytest.raises(UsageError) as err:
        make_plan(_count_inputs(gpu_memory=int(1.5 * GB)))
    assert str(err.value) == (
        "--params='1B': fits under no strategy on 8 x 1.4 GiB even before activations; the "
        "smallest need is FSDP2 full-shard at 1.9 GiB per GPU against 1.4 GiB usable (1.4 GiB "
        "less 0% headroom); use more GPUs or GPUs with more memory"
    )


def _linear_spec(name: str = "linear") -> ModelSpec:
    import torch

    return plan_inputs.spec_from_model(name, "path", torch.nn.Linear(8, 3))


def test_nothing_fits_at_this_micro_batch_asks_for_less_activation_memory(monkeypatch):
    """A model (not a count) whose states fit but whose activations do not: the flag to
    change is the micro-batch. Linear(8, 3) fp32 under DDP: 27 x (4 + 4 + 8) = 432 B of
    states; 10 kB of activations per sample (the profile given here)."""
    from dpkit.plan import recommend

    profile = ActivationProfile("trace", {"layers": 1e4}, {"layers": 0.0}, {"layers": 1e4})
    monkeypatch.setattr(recommend, "activation_profile", lambda *args: profile)
    inputs = PlanInputs(
        model=_linear_spec(), precision="fp32", gpu_memory=2000, reserve=0, headroom=0.5,
        gpus_per_node=2, micro_batch=2,
    )  # fmt: skip
    with pytest.raises(UsageError) as err:
        make_plan(inputs)
    message = str(err.value)
    assert message.startswith("--micro-batch=2: fits under no strategy on 2 x 0.0 GiB; ")
    assert message.endswith("lower --micro-batch or --seq-len, or add --activation-checkpointing")
    # States that do not fit even without activations: the model's flag.
    big = PlanInputs(
        model=_linear_spec("big"), precision="fp32", gpu_memory=400, reserve=0, headroom=0.0,
        gpus_per_node=2,
    )  # fmt: skip
    with pytest.raises(UsageError) as err:
        make_plan(big)
    assert str(err.value).startswith("--model='big': fits under no strategy on 2 x 0.0 GiB ")
    assert "even before activations" in str(err.value)


def test_the_plan_traces_the_attention_and_method_asked_for():
    """A tiny GPT-2 (2 layers, 4 heads, 64 tokens) planned in fp32. Eager attention keeps
    each layer's softmax output, 4 heads x 64 x 64 x 4 B per sample, which SDPA does not;
    the formula is used when asked for; an optimizer a strategy cannot run leaves that
    strategy without a largest micro-batch (None, not 0: nothing was tried)."""
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=2, n_embd=48, n_head=4, vocab_size=320, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    spec = plan_inputs.spec_from_config("tiny-gpt2", "path", config)

    def planned(**changes) -> Plan:
        return make_plan(
            PlanInputs(
                model=spec, seq_len=64, precision="fp32", gpus_per_node=2, reserve=0,
                headroom=0.0, **changes,
            )
        )  # fmt: skip

    sdpa, eager = planned(), planned(attention="eager")
    assert (sdpa.activations.method, eager.activations.method) == ("trace", "trace")
    extra = eager.activations.at_one["layers"] - sdpa.activations.at_one["layers"]
    assert extra >= 2 * 4 * 64 * 64 * 4
    assert planned(activation_method="formula").activations.method == "formula"
    cpu_adam = planned(optimizer="cpu_adam")
    assert cpu_adam.row("ddp").applicable is False
    assert cpu_adam.largest_micro_batches["ddp"] is None
    assert cpu_adam.largest_micro_batches["zero2_offload"] >= 1


def test_format_gib_rounds_to_one_decimal():
    assert [format_gib(x) for x in (0, 2**30, 1.25 * 2**30, 1.26 * 2**30, 80 * 2**30)] == [
        "0.0 GiB", "1.0 GiB", "1.2 GiB", "1.3 GiB", "80.0 GiB",
    ]  # fmt: skip


# --- the largest micro-batch: doubling, then bisecting, on the estimate itself ------------------


def _ddp_linear_inputs(gpu_memory: int) -> PlanInputs:
    return PlanInputs(
        model=_linear_spec(), precision="fp32", gpu_memory=gpu_memory, reserve=0, headroom=0.0,
        gpus_per_node=2,
    )  # fmt: skip


# DDP fp32, Linear(8, 3): 108 B of parameters, 108 of gradients, 216 of moments, bucket views:
# 432 B + activations. The profile: 700 B at micro-batch 1, 100 B fixed + 1000 B a sample on.
PROFILE = ActivationProfile("trace", {"layers": 700.0}, {"layers": 100.0}, {"layers": 1000.0})


@pytest.mark.parametrize(
    ("gpu_memory", "largest"),
    [
        (432 + 699, 0),  # not even one sample
        (432 + 700, 1),
        (432 + 100 + 2000 - 1, 1),
        (432 + 100 + 2000, 2),
        (432 + 100 + 3000, 3),
        (432 + 100 + 37_000, 37),
        (432 + 100 + 37_999, 37),
        (432 + 100 + 64_000, 64),
        (432 + 100 + 65_000, 65),
        (432 + 100 + 65_535_000, 65_535),
        (432 + 100 + 65_536_000, 65_536),
        (10**12, 65_536),  # capped: "more than you need"
    ],
)
def test_largest_micro_batch_is_the_boundary_worked_by_hand(gpu_memory, largest):
    inputs = _ddp_linear_inputs(gpu_memory)
    settings = plan.buffer_settings(inputs.model, 2)
    found = plan.largest_micro_batch(inputs, "ddp", PROFILE, settings)
    assert found == largest and type(found) is int  # a batch size, whatever the bisection
    assert plan.largest_micro_batch(inputs, "ddp", None, settings) is None
    # cpu_adam cannot run under DDP: nothing fits.
    cpu_adam = PlanInputs(
        model=inputs.model, precision="fp32", optimizer="cpu_adam", gpu_memory=gpu_memory,
        reserve=0, headroom=0.0, gpus_per_node=2,
    )  # fmt: skip
    assert plan.largest_micro_batch(cpu_adam, "ddp", PROFILE, settings) == 0


def test_activation_profile_parts_are_exact_at_one_and_a_line_from_two():
    profile = ActivationProfile("trace", {"a": 5.0, "b": 1.0}, {"a": 2.0}, {"a": 3.0, "b": 7.0})
    assert profile.parts(1) == {"a": 5.0, "b": 1.0}
    assert profile.parts(4) == {"a": 2.0 + 12.0, "b": 28.0}
    assert profile.at(1) == 6.0 and profile.at(4) == 42.0


# --- buffers and step temporaries, one rule at a time ---------------------------------------------


def test_buffer_settings_are_dpkits_over_deepspeeds_defaults():
    """A count has no hidden size: DeepSpeed's defaults stand (5e8-element bucket, contiguous
    gradients, no overlap). GPT-2 (hidden 768, 124M, largest parameter the 38.6M-element
    tied embedding, over the 2^21 bucket and a quarter of 124M / 8): dpkit's 2^21 bucket,
    contiguous gradients off, so no overlap either, on CUDA."""
    count = plan.buffer_settings(COUNT, 8)
    assert count == {
        "reduce_bucket_size": 500_000_000, "contiguous_gradients": True, "overlap_comm": False,
        "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
        "stage3_max_reuse_distance": 1_000_000_000, "gradient_as_bucket_view": True,
    }  # fmt: skip
    gpt2 = plan.buffer_settings(plan_inputs.load_model("gpt2"), 8)
    assert (gpt2["reduce_bucket_size"], gpt2["allgather_bucket_size"]) == (2**21, 2**21)
    assert (gpt2["contiguous_gradients"], gpt2["overlap_comm"]) == (False, False)
    assert gpt2["gradient_as_bucket_view"] is True
    # On one GPU a quarter of the partition (31M) is under the embedding (38.6M): still off.
    assert plan.buffer_settings(plan_inputs.load_model("gpt2"), 1)["contiguous_gradients"] is False


def test_frozen_parameters_are_held_gathered_and_cast_but_get_no_gradient():
    """A LoRA-shaped model by hand on 2 ranks, fp32 AdamW: one trainable (3, 4) weight in
    layer 0, one frozen (9, 2) weight in the root, 24 bytes of module buffers. FSDP2 pads
    dim 0 to a multiple of 2 per parameter: shards of 2x4 = 8 and 5x2 = 10 elements."""
    spec = ModelSpec(
        name="lora-by-hand", source="count", num_params=12, frozen_params=18,
        param_shapes=((3, 4), (9, 2)), trainable=(True, False), param_units=(0, -1),
        module_buffer_bytes=24,
    )  # fmt: skip

    def estimate(strategy: str, precision: str) -> plan.StrategyEstimate:
        inputs = PlanInputs(
            model=spec, gpus_per_node=2, precision=precision, reserve=0, headroom=0.0
        )
        return plan.estimate(inputs, strategy, 1, None, plan.buffer_settings(spec, 2))

    fsdp2 = estimate("fsdp2_full_shard", "fp32")
    # Both shards held (8 + 10 elements x 4 B); gradients and AdamW's two moments of the
    # trainable shard only.
    assert (fsdp2.params, fsdp2.grads, fsdp2.optimizer, fsdp2.master) == (72, 32, 64, 0)
    assert fsdp2.buffer_parts == {
        # the root (9 -> 10 rows x 2) and the one layer (3 -> 4 rows x 4) gathered whole
        "fsdp2_whole_params": 4 * (10 * 2 + 4 * 4),
        "fsdp2_root_whole_grads": 0,  # the root's one weight is frozen
        # the layer's whole gradients (12 x 4 B) and its fp32 reduce-scatter input (2 x 8 x
        # 4 B); the frozen root's would be 18 x 4 + 2 x 10 x 4 = 152
        "fsdp2_reduce_scatter": 12 * 4 + 2 * 8 * 4,
        "module_buffers": 24,
    }
    ddp = estimate("ddp", "bf16")
    assert (ddp.params, ddp.grads, ddp.optimizer) == (30 * 4, 12 * 4, 12 * 8)
    # Autocast casts every weight the forward uses, frozen or not: 2 B x 30.
    assert ddp.activation_parts == {"autocast_weight_copies": 2 * 30}
    assert ddp.buffer_parts["module_buffers"] == 24
    # A bare count has no layout: shard-grad-op's whole parameters, frozen ones too.
    count = ModelSpec(name="n", source="count", num_params=12, frozen_params=18)
    bare = PlanInputs(model=count, gpus_per_node=2, precision="fp32")
    settings = plan.buffer_settings(count, 2)
    row = plan.estimate(bare, "fsdp2_shard_grad_op", 1, None, settings)
    assert row.buffer_parts == {"fsdp2_whole_params": 4 * (12 + 18)}


def test_buffers_by_engine_and_setting():
    spec = ModelSpec(
        name="x", source="count", num_params=1000, largest_layer_params=300,
        small_tensor_params=40,
    )  # fmt: skip
    settings = {
        "gradient_as_bucket_view": False, "overlap_comm": True, "reduce_bucket_size": 100,
        "stage3_prefetch_bucket_size": 50,
    }  # fmt: skip
    # DDP without bucket views keeps a second copy of its gradients (the figure passed in).
    assert plan.buffer_bytes("ddp", spec, 2, "bf16", settings, 4000.0) == {
        "ddp_gradient_buckets": 4000.0
    }
    views = settings | {"gradient_as_bucket_view": True}
    assert plan.buffer_bytes("ddp", spec, 2, "bf16", views, 4000.0) == {"ddp_gradient_buckets": 0}
    # ZeRO-1/2: two reduce buckets with overlap_comm, in the module dtype; one without.
    for strategy in ("zero1", "zero2", "zero2_offload"):
        assert plan.buffer_bytes(strategy, spec, 2, "bf16", settings) == {"reduce_bucket": 400}
        assert plan.buffer_bytes(strategy, spec, 2, "fp32", settings) == {"reduce_bucket": 800}
    one = settings | {"overlap_comm": False}
    assert plan.buffer_bytes("zero2", spec, 2, "bf16", one) == {"reduce_bucket": 200}
    # ZeRO-3: one bucket, only with contiguous_gradients; the parameters gathered at the
    # end of the forward: the sharded ones (1000 - 40 small), at most the reuse distance +
    # the prefetch bucket + the largest layer (here 10 + 50 + 300 = 360 elements); the small
    # tensors every rank keeps, all in bf16.
    zero3 = settings | {"contiguous_gradients": True, "stage3_max_reuse_distance": 10}
    assert plan.buffer_bytes("zero3", spec, 2, "bf16", zero3) == {
        "reduce_bucket": 200, "gathered_params": 2 * 360, "persistent_small_tensors": 80,
    }  # fmt: skip
    wide = zero3 | {"stage3_max_reuse_distance": 10_000}  # the whole sharded model
    assert plan.buffer_bytes("zero3", spec, 2, "bf16", wide)["gathered_params"] == 2 * 960
    off = zero3 | {"contiguous_gradients": False}
    assert plan.buffer_bytes("zero3", spec, 2, "bf16", off)["reduce_bucket"] == 0


def test_zero_buffers_follow_the_parameter_layout():
    """With the parameters known, ZeRO-1/2 hold the bucket only with contiguous gradients,
    and either way the flat copy of the fullest bucket made to reduce it (measured: GPT-2
    124M, 2 ranks, a 2^21 bucket, contiguous off: 1,771,776 elements, the only buffer).
    ZeRO-2 reduces in backward's order (the model's reversed), ZeRO-1 in group order."""
    spec = ModelSpec(
        name="x", source="count", num_params=355, param_groups=((60, 30, 150, 20), (5, 90)),
        param_order=((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)),
    )  # fmt: skip
    settings = {"overlap_comm": False, "reduce_bucket_size": 100, "contiguous_gradients": True}
    # Backward: 90 + 5 | 20 | 150 | 30 + 60, fullest 95; group order: 90 | 150 | 25 | 90.
    assert plan.buffer_bytes("zero2", spec, 2, "fp32", settings) == {
        "reduce_bucket": 4 * 100, "reduce_flat_copy": 4 * 95
    }  # fmt: skip
    assert plan.buffer_bytes("zero1", spec, 2, "bf16", settings) == {
        "reduce_bucket": 2 * 100, "reduce_flat_copy": 2 * 90
    }  # fmt: skip
    off = settings | {"contiguous_gradients": False}
    assert plan.buffer_bytes("zero2", spec, 2, "fp32", off) == {
        "reduce_bucket": 0, "reduce_flat_copy": 4 * 95
    }  # fmt: skip
    # Without the model's own order (a spec of groups only), backward reverses the groups.
    unordered = ModelSpec(name="x", source="count", num_params=355,
                                      param_groups=spec.param_groups)  # fmt: skip
    assert plan.buffer_bytes("zero2", unordered, 2, "fp32", settings)["reduce_flat_copy"] == 4 * 95
    overlap = settings | {"overlap_comm": True}  # two buckets, one copy at a time
    assert plan.buffer_bytes("zero2", spec, 2, "fp32", overlap) == {
        "reduce_bucket": 2 * 4 * 100, "reduce_flat_copy": 4 * 95
    }  # fmt: skip


@pytest.mark.parametrize(
    ("strategy", "precision", "laid_out", "parts"),
    [
        ("zero1", "bf16", False, {"flat_grad_partition": 2 * 1000 / 4}),
        ("zero2", "fp32", False, {"flat_grad_partition": 4 * 1000 / 4}),
        ("zero2", "bf16", True, {}),  # part of the laid-out gradients instead
        ("zero2_offload", "bf16", False, {}),  # built in host memory
        ("zero3", "bf16", False, {}),  # its fp32 copy is among the gradients
        ("ddp", "bf16", False, {}),  # fused AdamW updates in place
        ("fsdp2_full_shard", "bf16", False, {}),
    ],
)
def test_step_temporaries(strategy, precision, laid_out, parts):
    assert plan.step_bytes(strategy, "adamw", 1000, 4, laid_out, precision) == parts


def test_the_worst_ranks_backward_and_step_may_be_on_different_ranks():
    """fp32 ZeRO-2, N=2, one group [12, 4, 16], a 13-element bucket, no contiguous buffers
    (tests/test_zero_layout.py's layout): partitions of 16. Rank 0 touches 12 and 4, and
    holds the unreduced 16 (over the bucket) in backward: 4 x 32 = 128 B; at its step the
    flat copy of its partition (two tensors) beside its 16 whole: 128 B. Rank 1 owns the
    16: backward 64 B; its step (last rank, a copy) 4 x (16 + 16) = 128 B."""
    spec = ModelSpec(
        name="x", source="path", num_params=32, param_groups=((12, 4, 16),),
        param_order=((0, 0), (0, 1), (0, 2)),
    )  # fmt: skip
    inputs = PlanInputs(model=spec, gpus_per_node=2, precision="fp32", reserve=0)
    settings = plan.buffer_settings(spec, 2) | {
        "reduce_bucket_size": 13,
        "contiguous_gradients": False,
        "overlap_comm": False,
    }
    row = plan.estimate(inputs, "zero2", 1, None, settings)
    assert (row.grads, row.grads_backward, row.grads_step) == (128, 128, 128)
    assert row.grads_where == "rank 0, backward (partition + a parameter larger than the bucket)"
    assert row.grads_paper == 4 * 32 / 2
    assert row.step_parts == {}  # the step's copy is in the laid-out gradients
    # Two micro-batches a step: rank 0 holds its accumulated 16 whole gradients beside a
    # later backward's 16 and unreduced 16: 4 x 48.
    two = PlanInputs(
        model=spec, gpus_per_node=2, precision="fp32", reserve=0, gradient_accumulation_steps=2
    )
    assert plan.estimate(two, "zero2", 1, None, settings).grads_backward == 4 * 48
    # Not laid out: DDP (its 4 Psi), ZeRO-3 (its partition and the step's fp32 copy of it,
    # twice the paper's in fp32), a bare count.
    for strategy, grads in (("ddp", 128), ("zero3", 2 * 64)):
        other = plan.estimate(inputs, strategy, 1, None, settings)
        assert (other.grads, other.grads_backward, other.grads_step) == (grads, None, None)
        assert other.grads_where == ""
    # Offload: on the device only the whole gradient of the 16 (over the bucket) waiting
    # for its copy to host memory, at the end of backward: 4 x 16; none at the step.
    offload = plan.estimate(inputs, "zero2_offload", 1, None, settings)
    assert (offload.grads, offload.grads_backward, offload.grads_step) == (64, 64, 0)


def test_why_zero3_points_to_a_config_of_ones_own():
    """ZeRO-3 comes last (dpkit runs DeepSpeed up to ZeRO-2): chosen, the reason says so."""
    from dpkit.engines import get_strategy

    inputs = _count_inputs(gpu_memory=100 * GB)
    row = make_plan(inputs).row("zero3")
    zero3 = get_strategy("zero3")
    assert engine_of(zero3).plan.why(zero3, row, inputs) == (
        "Only ZeRO-3 fits: it shards the parameters too, all-gathering them in forward and "
        "backward (1.5x DDP's communication). dpkit runs DeepSpeed up to ZeRO-2, and FSDP2 "
        "full-shard does not fit; ZeRO-3 needs a DeepSpeed config of your own."
    )


@pytest.mark.parametrize(
    ("usable", "flag"),
    [
        # 135 B of states, 7 of buffers, 8 of reserve, 20 of step: 170 B before activations.
        (170, "--micro-batch=1: "),
        (169, "--model='tiny': "),
    ],
)
def test_nothing_fits_blames_activations_only_when_the_rest_fits(usable, flag):
    """The smallest row needs its states (params 100, grads 20, optimizer 10, master 5),
    buffers 7, reserve 8 and step 20 before any activation; its activations (1000 B) are
    what overflows only when those fit in the usable memory, to the byte."""
    from dpkit.plan.estimate import StrategyEstimate
    from dpkit.plan.recommend import _nothing_fits

    row = StrategyEstimate(
        "zero2", True, params=100, grads=20, optimizer=10, master=5, buffers=7, reserve=8,
        step=20, activations=1000,
    )  # fmt: skip
    larger = StrategyEstimate("ddp", True, params=10**6)
    cannot = StrategyEstimate("zero2_offload", False)
    inputs = PlanInputs(
        model=ModelSpec(name="tiny", source="path", num_params=1),
        gpu_memory=usable, reserve=0, headroom=0.0,
    )  # fmt: skip
    message = str(_nothing_fits(inputs, [larger, cannot, row]))
    assert message.startswith(flag)
    assert "the smallest need is ZeRO-2 at 0.0 GiB per GPU" in message


def _layout_spec(groups, order, hidden=4096, **extra) -> ModelSpec:
    from types import SimpleNamespace

    return ModelSpec(
        name="layout", source="path", num_params=sum(map(sum, groups)),
        config=SimpleNamespace(hidden_size=hidden), param_groups=groups, param_order=order,
        **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("world_size", "on_cuda", "contiguous", "overlap"),
    [
        # 10^9 parameters, the largest 5 x 10^7, over the 4096^2 = 16.8M bucket. At N = 1 a
        # quarter of the partition (2.5 x 10^8) is larger: contiguous gradients, and on
        # CUDA ZeRO-2 overlaps its reduction. At N = 8 (3.1 x 10^7) it is not: off, both.
        (1, True, True, True),
        (1, False, True, False),
        (8, True, False, False),
    ],
)
def test_buffer_settings_size_zero_to_the_layout_and_the_device(
    world_size, on_cuda, contiguous, overlap
):
    spec = _layout_spec(((5 * 10**7,) + (10**7,) * 95,), tuple((0, i) for i in range(96)))
    settings = plan.buffer_settings(spec, world_size, on_cuda=on_cuda)
    assert settings["reduce_bucket_size"] == 4096 * 4096
    assert (settings["contiguous_gradients"], settings["overlap_comm"]) == (contiguous, overlap)
    assert settings["gradient_as_bucket_view"] is True
    assert settings["stage3_prefetch_bucket_size"] == 50_000_000  # DeepSpeed's, untouched
    if on_cuda:  # plan targets GPUs unless told otherwise
        assert plan.buffer_settings(spec, world_size) == settings


def test_zero2_contiguous_gradients_arrive_in_the_models_reverse_order():
    """Two Linear layers as the recipes' groups: weights [w1, w2], biases [b1, b2]; backward
    yields b2, w2, b1, w1 (the model's order reversed), not the groups' order reversed (b2,
    b1, w2, w1). ZeRO-2 with contiguous gradients, fp32, N = 2, a 6-element bucket: the
    high-water is what tests/test_zero_layout.py's walk over live tensors gives for that
    arrival, and the other order gives another figure."""
    from tests.test_zero_layout import _step_by_hand, _walk_zero2

    groups = ((12, 8), (3, 5))  # w1 4x3, w2 2x4; b1 3, b2 5 (sizes only)
    order = ((0, 0), (1, 0), (0, 1), (1, 1))
    spec = _layout_spec(groups, order)
    inputs = PlanInputs(model=spec, gpus_per_node=2, precision="fp32", reserve=0)
    settings = plan.buffer_settings(spec, 2) | {
        "reduce_bucket_size": 6,
        "contiguous_gradients": True,
    }
    row = plan.estimate(inputs, "zero2", 1, None, settings)
    backward = order[::-1]
    by_rank = [
        max(4 * _walk_zero2(groups, 2, r, 6, backward), _step_by_hand(groups, 2, r, 4))
        for r in range(2)
    ]
    assert row.grads == max(by_rank)
    other = [(1, 1), (1, 0), (0, 1), (0, 0)]
    assert max(4 * _walk_zero2(groups, 2, r, 6, other) for r in range(2)) != max(
        4 * _walk_zero2(groups, 2, r, 6, backward) for r in range(2)
    )
    # The same layout in bf16: 2-byte gradients, and the step's fp32 cast.
    bf16 = PlanInputs(model=spec, gpus_per_node=2, precision="bf16", reserve=0)
    row16 = plan.estimate(bf16, "zero2", 1, None, settings)
    assert row16.grads == max(
        max(2 * _walk_zero2(groups, 2, r, 6, backward), _step_by_hand(groups, 2, r, 2))
        for r in range(2)
    )


def test_zero_buffer_settings_for_one_gpu_unless_told_and_for_a_spec_without_groups():
    """``buffer_settings``' world defaults to one GPU. It decides whether ZeRO-2 keeps
    contiguous gradients: a parameter larger than the bucket (2^21 elements: hidden 16
    squared is below DeepSpeed's floor) and than a quarter of this rank's partition is
    reduced alone, beside its slot in the contiguous buffer, so dpkit turns both off.
    100M parameters in five of 20M: a quarter of the partition is 25M on one GPU (20M
    is not above it), 12.5M on two (it is). A spec without parameter groups (a report
    from before they were recorded) has no largest parameter: the settings still come."""
    from transformers import GPT2Config

    config = GPT2Config(n_embd=16, n_layer=1, n_head=2)
    spec = ModelSpec(
        name="five-20M", source="config", num_params=100_000_000, config=config,
        param_groups=((20_000_000,) * 5,),
    )  # fmt: skip
    assert plan.buffer_settings(spec)["contiguous_gradients"] is True
    assert plan.buffer_settings(spec, 2)["contiguous_gradients"] is False
    ungrouped = ModelSpec(name="ungrouped", source="config", num_params=100_000_000, config=config)
    assert plan.buffer_settings(ungrouped)["contiguous_gradients"] is True
    # DDP's buckets mirror the gradients they are given; none given, none counted.
    settings = {**plan.buffer_settings(spec), "gradient_as_bucket_view": False}
    assert plan.buffer_bytes("ddp", spec, 2, "fp32", settings) == {"ddp_gradient_buckets": 0}
    assert plan.buffer_bytes("ddp", spec, 2, "fp32", settings, 400.0) == {
        "ddp_gradient_buckets": 400
    }
