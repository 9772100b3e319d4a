# Spike (issue 51), one process: run with PYTHONPATH=<checkout> python docs/spikes/zero3_init_check.py
"""1 process: do the ZeRO-3 (transformers integration) weights equal a DDP build, and what does a
plain zero.Init build give (negative control)?"""
import os, torch, deepspeed
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
import torch.distributed as dist
from dpkit.engines.deepspeed.config import skip_deepspeed_cpu_shm_op; skip_deepspeed_cpu_shm_op()
dist.init_process_group("gloo")
deepspeed.init_distributed("gloo"); print("dist up", flush=True)
from transformers import AutoModelForCausalLM
from transformers.initialization import no_init_weights
from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config
from dpkit.data import lm as lm_data
w = lm_data.LMWorkload(size="tiny", synthetic=True, seq_len=32, micro_batch_size=2)
cfg = lm_data.lm_config(w)
ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
def sd(m): return {k: v.detach().clone() for k, v in m.state_dict().items()}
def loss(m): return float(m(input_ids=ids, labels=ids).loss)
ddp = lm_data.build_lm(cfg, 42); ddp_sd = sd(ddp); print("ddp build_lm loss", loss(ddp))
torch.manual_seed(42)
with no_init_weights():
    m2 = AutoModelForCausalLM.from_config(cfg)
torch.manual_seed(42); m2.initialize_weights(); m2.tie_weights()
m2_sd = sd(m2); print("no_init+seed+initialize_weights loss", loss(m2))
ds = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}}
keep = HfDeepSpeedConfig(ds)
torch.manual_seed(42)
z = AutoModelForCausalLM.from_config(cfg)
with deepspeed.zero.GatheredParameters(list(z.parameters())):
    z_sd = sd(z)
    print("numel of a param", next(z.parameters()).numel(), "ds_numel", next(z.parameters()).ds_numel)
def cmp(a, b, name):
    diff = max(float((a[k] - b[k]).abs().max()) for k in a if k in b)
    print(f"{name}: max abs diff {diff:.3g}", "keys", len(a), len(b))
cmp(ddp_sd, z_sd, "build_lm vs zero3"); cmp(m2_sd, z_sd, "seeded-init vs zero3"); cmp(ddp_sd, m2_sd, "build_lm vs seeded-init")
unset_hf_deepspeed_config(); del keep
from transformers import GPT2LMHeadModel
torch.manual_seed(42)
with deepspeed.zero.Init(config_dict_or_path=ds):
    neg = GPT2LMHeadModel(cfg)
eng = deepspeed.initialize(model=neg, config=ds, model_parameters=neg.parameters(), optimizer=torch.optim.SGD(neg.parameters(), lr=0.0))[0]
print("negative control (zero.Init, no integration) loss", float(eng(input_ids=ids, labels=ids).loss))
