"""``dpkit consolidate``: a real DeepSpeed ZeRO-2 checkpoint (2 processes, `deepspeed`
launcher) becomes a model folder that loads without DeepSpeed. A dpkit checkpoint's
consolidation is checked on tests/test_checkpoint.py's ZeRO-2 run (no launch of its own)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import BIN, free_port, run, run_captured

pytestmark = pytest.mark.multiprocess

# Two ZeRO-2 steps of the MiniLM classifier on two ranks, then DeepSpeed's own save
# (shards of every rank), and the fp32 masters gathered by rank 0 as the reference.
ZERO2_SCRIPT = textwrap.dedent(
    """
    import sys
    import deepspeed, torch
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file
    from transformers import AutoModelForSequenceClassification
    from dpkit.models import local_model_path
    from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op

    out = sys.argv[-1]  # the deepspeed launcher puts --local_rank=N first
    skip_deepspeed_cpu_shm_op()
    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        local_model_path("sentence-transformers/all-MiniLM-L6-v2"), num_labels=3
    )
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(1000, 2000, (2, 16), generator=torch.Generator().manual_seed(engine.global_rank))
    for _ in range(2):
        loss = engine(input_ids=ids, labels=torch.tensor([0, 2])).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out, tag="global_step2")
    full = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    if engine.global_rank == 0:
        save_file(full, out + "/reference_fp32.safetensors")
    # As in dpkit/bench/bare_deepspeed.py: without both, a rank can abort at exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    """
)
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _dpkit(*args: str) -> subprocess.CompletedProcess:
    return run_captured([str(BIN / "dpkit"), *args])


def _load_without_deepspeed(model_dir) -> dict[str, torch.Tensor]:
    script = (
        "import sys; from transformers import AutoModelForSequenceClassification as M\n"
        f"m = M.from_pretrained({str(model_dir)!r})\n"
        "assert 'deepspeed' not in sys.modules\n"
        "import torch; torch.save(dict(m.named_parameters()), sys.argv[1])\n"
    )
    dump = model_dir.parent / f"{model_dir.name}.pt"
    done = run_captured([sys.executable, "-c", script, str(dump)])
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(dump, weights_only=True)


@pytest.fixture(scope="module")
def zero2_checkpoint(module_tmp):
    root = module_tmp
    script = root / "train_and_save.py"
    script.write_text(ZERO2_SCRIPT)
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    run([*cmd, str(script), str(root / "ckpt")]).check()
    return root / "ckpt"


def test_deepspeed_zero2_checkpoint_consolidates_to_the_fp32_masters(zero2_checkpoint, tmp_path):
    shards = sorted(p.name for p in (zero2_checkpoint / "global_step2").glob("*optim_states.pt"))
    assert len(shards) == 2  # one optimizer shard per rank
    out = tmp_path / "model"
    done = _dpkit("consolidate", str(zero2_checkpoint), "--model", MINILM, "--output-dir", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DeepSpeed checkpoint global_step2" in done.stdout
    # MiniLM's config names BertModel; the checkpoint's 3-class head makes it the classifier.
    assert ", as BertForSequenceClassification -> " in done.stdout, done.stdout
    loaded = _load_without_deepspeed(out)
    reference = load_file(str(zero2_checkpoint / "reference_fp32.safetensors"))
    assert set(loaded) == set(reference)
    for name, value in reference.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], value), name
    assert (out / "tokenizer.json").is_file()


def test_deepspeed_checkpoint_without_latest_needs_a_tag(zero2_checkpoint, tmp_path):
    (zero2_checkpoint / "latest").rename(zero2_checkpoint / "latest.bak")
    try:
        done = _dpkit(
            "consolidate",
            str(zero2_checkpoint),
            "--model",
            MINILM,
            "--output-dir",
            str(tmp_path / "m"),
        )
        assert done.returncode == 2
        assert done.stderr.strip().endswith("no 'latest' file; pass --tag (one of: global_step2)")
        assert not (tmp_path / "m").exists()
        done = _dpkit(
            "consolidate", str(zero2_checkpoint), "--model", MINILM, "--tag", "global_step9",
            "--output-dir", str(tmp_path / "m"),
        )  # fmt: skip
        assert done.returncode == 2
        assert "--tag='global_step9': not in" in done.stderr
    finally:
        (zero2_checkpoint / "latest.bak").rename(zero2_checkpoint / "latest")
