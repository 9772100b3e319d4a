# Spike (issue 51), one process: run with PYTHONPATH=<checkout> python docs/spikes/zero3_helpers_probe.py
"""1 process, ZeRO-3 via transformers' integration: what dpkit's helpers read of a partitioned model."""
import os, torch, deepspeed
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
import torch.distributed as dist
from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op; skip_deepspeed_cpu_shm_op()
dist.init_process_group("gloo"); deepspeed.init_distributed("gloo")
from transformers.integrations import HfDeepSpeedConfig
from dpkit.data import lm as lm_data
from dpkit import models, lora
from dpkit.memory.tracker import count_params, largest_param, param_shapes
cfg = lm_data.lm_config(lm_data.LMWorkload(size="tiny", synthetic=True, seq_len=32))
keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1, "zero_optimization": {"stage": 3}})
m = lm_data.build_lm(cfg, 42)
p = m.transformer.wte.weight
print("shape", tuple(p.shape), "ndim", p.ndim, "ds_shape", tuple(p.ds_shape), "ds_numel", p.ds_numel)
print("count_parameters", models.count_parameters(m), "real", sum(q.ds_numel for q in m.parameters()))
print("count_params", count_params(m), "largest_param", largest_param(m), "shapes[:2]", param_shapes(m)[:2])
g = models.adamw_param_groups(m, 0.01)
print("adamw groups (n params, wd):", [(len(x["params"]), x["weight_decay"]) for x in g])
print("frozen_and_trainable", lora.frozen_and_trainable(m))
try:
    lm = lora.apply_lora(m, lora.LoraSettings(r=4, alpha=8.0))
    a = [(n, tuple(q.shape), hasattr(q, "ds_id")) for n, q in lm.named_parameters() if "lora_" in n][:2]
    print("lora ok", a, "frozen_and_trainable", lora.frozen_and_trainable(lm))
except Exception as e:
    print("lora FAILED", type(e).__name__, str(e)[:300])
