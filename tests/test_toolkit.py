"""dpkit as a toolkit: installed from a wheel, used from a script of one's own, its configs in plain accelerate.

* The wheel carries everything dpkit reads at run time (configs, metrics, recipes) and
  runs from another folder (``wheel_env``: a fresh venv outside the checkout).
* The README's own-script example ("Your own script: four dpkit calls around your loop"), copied out of
  the README, runs from that folder against the wheel as DDP, ZeRO-2 and FSDP2
  shard-grad-op (torchrun, ``--strategy``), on its default model (``minilm``, the bundled
  MiniLM) with no network: real 2-process jobs, the same losses.
* The shipped accelerate YAML and DeepSpeed JSON work in a plain accelerate script
  without dpkit, given what their header says (the gloo backend on CPU).
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import zipfile

import pytest

from dpkit.data.embedded import rotten_tomatoes_csv
from tests.harness import REPO, free_port, max_rel_diff, run

README = REPO / "README.md"


def test_public_api_is_documented_and_the_recipes_use_nothing_else():
    import ast

    import dpkit

    api_doc = (REPO / "docs" / "api.md").read_text()
    for name in dpkit.__all__:
        value = getattr(dpkit, name)  # every export resolves
        assert re.search(rf"`{re.escape(name)}[`(.]", api_doc), f"{name} not in docs/api.md"
        if callable(value):
            assert (value.__doc__ or "").strip(), f"dpkit.{name} has no docstring"
    # The integrations are public modules of their own (their __all__, in docs/api.md).
    import dpkit.integrations.transformers as hf_integration

    integrations = {"dpkit.integrations.transformers": hf_integration}
    for name in hf_integration.__all__:
        assert re.search(rf"`{re.escape(name)}[`(.]", api_doc), f"{name} not in docs/api.md"
        assert (getattr(hf_integration, name).__doc__ or "").strip(), name

    # The helper modules docs/api.md documents ("Helpers outside the top level") that a
    # training script may import; each name a recipe takes from one is in that table.
    helpers = (
        "dpkit.models",
        "dpkit.data.classification",
        "dpkit.data.causal",
        "dpkit.data.causal_tokens",
        "dpkit.data.lm",
        "dpkit.train.output",
    )

    def documented(name: str) -> bool:
        return re.search(rf"`{re.escape(name)}[`(.]", api_doc) is not None

    for recipe in sorted((REPO / "recipes").glob("*.py")):
        tree = ast.parse(recipe.read_text())
        bound: dict[str, str] = {}  # a name the recipe binds to a helper module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in integrations:
                public = integrations[node.module].__all__
                assert all(a.name in public for a in node.names), f"{recipe.name}: {node.module}"
            elif isinstance(node, ast.ImportFrom) and node.module in helpers:
                for a in node.names:
                    assert documented(a.name), f"{recipe.name}: {node.module}.{a.name}"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpkit"):
                for a in node.names:
                    module = f"{node.module}.{a.name}"
                    if module not in helpers:
                        raise AssertionError(f"{recipe.name}: from {node.module} import {a.name}")
                    bound[a.asname or a.name] = module
            if isinstance(node, ast.Import):
                assert all(a.name == "dpkit" or not a.name.startswith("dpkit") for a in node.names)
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "dpkit":
                assert node.attr in dpkit.__all__, f"{recipe.name}: dpkit.{node.attr}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in bound:
                module = bound[node.value.id]
                assert documented(node.attr), f"{recipe.name}: {module}.{node.attr}"


def test_packaged_configs_are_the_repositorys():
    """dpkit reads its packaged copies at run time; users copy ds_configs/: the same files."""
    pairs = [
        (REPO / "ds_configs" / f"{name}.json", REPO / "dpkit/configs/deepspeed" / f"{name}.json")
        for name in ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")
    ]
    pairs += [
        (path, REPO / "dpkit/configs/accelerate" / path.name)
        for path in sorted((REPO / "ds_configs" / "accelerate").glob("*.yaml"))
    ]
    assert len(pairs) == 14  # 5 DeepSpeed JSONs, 9 accelerate YAMLs
    for user_copy, packaged in pairs:
        assert packaged.read_bytes() == user_copy.read_bytes(), f"{packaged} != {user_copy}"


def test_shipped_configs_leave_auto_only_where_accelerate_fills_it():
    """Accelerate fills batch sizes, clipping, precision and (from model.config's hidden
    size) reduce_bucket_size; an "auto" anywhere else stops a plain accelerate script
    ("zero_optimization.allgather_bucket_size not found in kwargs")."""
    fillable = {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "bf16.enabled",
        "fp16.enabled",
        "zero_optimization.reduce_bucket_size",
    }

    def leaves(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    for name in ("zero1", "zero2"):
        config = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
        autos = {key for key, value in leaves(config) if value == "auto"}
        assert autos == fillable, name
    for name in ("zero1", "zero2"):
        text = (REPO / "ds_configs" / "accelerate" / f"{name}.yaml").read_text()
        # accelerate refuses a mixed_precision line beside a deepspeed_config_file
        assert not re.search(r"^mixed_precision:", text, re.M), name


def test_wheel_carries_what_dpkit_reads_at_run_time(wheel_env):
    names = set(zipfile.ZipFile(wheel_env.wheel).namelist())
    for required in (
        "dpkit/configs/deepspeed/zero2.json",
        "dpkit/configs/accelerate/zero1.yaml",
        "dpkit/configs/models/gpt2.json",
        "dpkit/metrics/f1/f1.py",
        "dpkit/recipes/train_lm.py",
        "dpkit/recipes/finetune.py",
        "dpkit/recipes/trainer_finetune.py",
        "dpkit/integrations/transformers.py",
        "dpkit/bench/bare_deepspeed.py",
    ):
        assert required in names, required
    # Every module of the checkout's package: a subpackage missing from pyproject.toml's
    # list would be left out of the wheel with no error at build time.
    modules = {str(p.relative_to(REPO)) for p in (REPO / "dpkit").rglob("*.py")}
    assert not sorted(modules - names)
    assert not [n for n in names if n.startswith(("tests/", "ds_configs/"))]


@pytest.mark.multiprocess
def test_plan_runs_from_the_wheel_in_another_folder(wheel_env, tmp_path):
    result = wheel_env.run(["dpkit", "plan", "--model", "gpt2", "--json"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["model"]["num_params"] == 124_439_808  # GPT-2's published count, bundled config
    assert plan["recommendation"]["strategy"] == "ddp"
    where = wheel_env.run(["python", "-c", "import dpkit; print(dpkit.__file__)"], tmp_path)
    assert where.stdout.startswith(str(wheel_env.root)), where.stdout


# The model the README example names by default: dpkit's short name of the bundled MiniLM,
# which it must find with no network.
README_MODEL = "minilm"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
OWN_SCRIPT_STRATEGIES = ("ddp", "zero2", "fsdp2_shard_grad_op")


def readme_example() -> str:
    """The first python block of the README's own-script section."""
    text = README.read_text()
    section = text.split("## Your own script: four dpkit calls around your loop", 1)[1].split(
        "\n## ", 1
    )[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def own_script(tmp_path_factory, wheel_env):
    """The README example in a folder of its own with its data (no ds_configs/), run
    against the wheel as the README launches it: ``torchrun --nproc_per_node 2 train.py
    --strategy ...`` for DDP and FSDP2 shard-grad-op, and ZeRO-2 with the repository's
    shipped YAML (``accelerate launch --config_file <checkout>/ds_configs/accelerate/
    zero2.yaml``, whose ``ds_configs/zero2.json`` exists neither here nor beside the YAML:
    the wheel's copy runs), one launch each, as written (its default model), with no
    network: the Hub and transformers offline, no ``MODEL`` variable."""
    folder = tmp_path_factory.mktemp("own_script")
    example = readme_example()
    assert f'local_model_path(os.environ.get("MODEL", "{README_MODEL}"))' in example
    (folder / "train.py").write_text(example)
    with open(rotten_tomatoes_csv()) as source, open(folder / "reviews.csv", "w") as target:
        rows = list(csv.reader(source))[:193]  # the header and 192 reviews: 6 steps at 2 x 16
        csv.writer(target).writerows(rows)
    launches = {
        name: ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
               "train.py", "--strategy", name]
        for name in OWN_SCRIPT_STRATEGIES
    }  # fmt: skip
    launches["zero2"] = [
        "accelerate", "launch", "--config_file", str(REPO / "ds_configs/accelerate/zero2.yaml"),
        "--num_processes", "2", "--main_process_port", str(free_port()), "train.py",
    ]  # fmt: skip
    results = {}
    for name, cmd in launches.items():
        out = folder / name
        out.mkdir()
        shutil.copy(folder / "train.py", out)
        shutil.copy(folder / "reviews.csv", out)
        assert "MODEL" not in wheel_env.env()  # the example's own default runs
        result = wheel_env.run(cmd, cwd=out, env=OFFLINE)
        # dpkit plan --against the script's own run, as the wheel's python -m dpkit runs it.
        plan = wheel_env.run(
            ["python", "-m", "dpkit", "plan", "--against", "out"], cwd=out, env=OFFLINE
        )
        results[name] = (result, out, plan)
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", OWN_SCRIPT_STRATEGIES)
def test_readme_example_runs_against_the_wheel(own_script, name):
    result, out, plan = own_script[name]
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    if name == "zero2":  # the shipped YAML's JSON, found as the wheel's copy, said once
        found = [line for line in output.splitlines() if "using dpkit's copy" in line]
        assert len(found) == 1 and "site-packages/dpkit/configs/deepspeed/zero2.json" in found[0]
    # The plan of the run's own model and settings beside what it measured.
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert re.search(r"^total\s+[0-9.,]+\s+[0-9.,]+\s+[-+][0-9.]+%$", plan.stdout, re.M), (
        plan.stdout
    )
    strategy_lines = [line for line in output.splitlines() if "strategy=" in line]
    assert len(strategy_lines) == 1, output[-3000:]  # logged once, by the main process
    assert f"strategy={name}" in strategy_lines[0] and "world_size=2" in strategy_lines[0]
    wrapper = {
        "ddp": "DistributedDataParallel",
        "zero2": "DeepSpeedEngine+DeepSpeedZeroOptimizer",
        "fsdp2_shard_grad_op": "FSDP2 fully_shard (8 units)+AdamW",
    }[name]
    assert f"wrapper={wrapper}" in strategy_lines[0]
    synced_at_init_only = "buffers synced at init only" in strategy_lines[0]
    assert synced_at_init_only == (name == "ddp")
    report = json.loads((out / "out" / "memory_report.json").read_text())
    assert report["strategy"] == name and len(report["ranks"]) == 2
    assert report["grads_measured"] is True
    (checkpoint,) = (out / "out" / "checkpoints").glob("step-*")
    assert (checkpoint / "manifest.json").is_file() and (checkpoint / "config.json").is_file()
    # Sharded by default: each of the 2 ranks wrote its own part of the state.
    shards = sorted(p.name for p in (checkpoint / "shards").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert "step 6: loss" in output


@pytest.mark.multiprocess
def test_readme_example_losses_agree_across_strategies(own_script):
    """The example seeds its head, dropout and data order: DDP, ZeRO-2 and FSDP2 train the
    same model on the same batches, so their losses agree (measured here: equal to the 4
    printed decimals)."""
    losses = {}
    for name, (result, _, _) in own_script.items():
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        losses[name] = [
            float(m) for m in re.findall(r"step \d+: loss ([0-9.]+)", result.stdout + result.stderr)
        ]
    assert len(losses["ddp"]) == len(losses["zero2"]) == len(losses["fsdp2_shard_grad_op"]) == 6
    # The tolerance of tests/test_launchers.py (DDP against ZeRO, argued there); FSDP2's
    # losses are printed to 4 decimals, so the same bound holds them.
    assert max_rel_diff(losses["ddp"], losses["zero2"]) < 2e-3
    assert max_rel_diff(losses["ddp"], losses["fsdp2_shard_grad_op"]) < 2e-3


PLAIN_SCRIPT = """
import sys, torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from transformers import GPT2Config, GPT2LMHeadModel

# What the YAML's header says a script without dpkit needs on a machine without CUDA.
accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(torch.randint(0, 512, (64, 32)), batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for step, ids in enumerate(loader):
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    if step == 2:
        break
accelerator.save_state(sys.argv[1])
zero = accelerator.deepspeed_engine_wrapped.engine.optimizer
accelerator.print("RAN", accelerator.distributed_type, accelerator.num_processes,
                  type(zero).__name__, zero.partition_count)
"""


@pytest.mark.multiprocess
def test_shipped_zero2_yaml_works_in_a_plain_accelerate_script(tmp_path):
    """No dpkit: the files users copy first work in the accelerate script they already have."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    from tests.harness import accelerate_cmd

    cmd = accelerate_cmd(
        ["--config_file", "ds_configs/accelerate/zero2.yaml", "--num_processes", "2"],
        recipe=str(script),
    )
    result = run([*cmd, str(tmp_path / "state")]).check()
    assert "RAN DistributedType.DEEPSPEED 2 DeepSpeedZeroOptimizer [2]" in result.output
    assert (tmp_path / "state" / "pytorch_model").is_dir()
