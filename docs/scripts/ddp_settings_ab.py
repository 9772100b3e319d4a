"""One run of the DDP-settings measurement in docs/bench.md ("DDP settings, measured").

MiniLM's classifier, plain torch DDP (no dpkit, no accelerate: DDP's own settings
alone), fixed random batches of 32 x 64 tokens per rank, dpkit's AdamW, clipping 1.0,
gradient_as_bucket_view on; 1 warm-up step and 10 timed. Rank 0 writes the step times.

    torchrun --nproc_per_node 2 docs/scripts/ddp_settings_ab.py '{"bucket_cap_mb": 100}' out.json

The variants and rounds: docs/scripts/ddp_settings_ab.sh.
"""
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForSequenceClassification
from dpkit.models import local_model_path, adamw, adamw_param_groups

variant = json.loads(sys.argv[1]); out = sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
path = local_model_path("sentence-transformers/all-MiniLM-L6-v2")
model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
kw = dict(gradient_as_bucket_view=True, bucket_cap_mb=variant.get("bucket_cap_mb", 25),
          static_graph=variant.get("static_graph", False),
          broadcast_buffers=variant.get("broadcast_buffers", True))
ddp = DDP(model, **kw)
opt = adamw(adamw_param_groups(ddp.module, 0.01), lr=5e-5, weight_decay=0.01)
g = torch.Generator().manual_seed(rank)
B, T = 32, 64
batches = [dict(input_ids=torch.randint(1000, 20000, (B, T), generator=g),
                attention_mask=torch.ones(B, T, dtype=torch.long),
                labels=torch.randint(0, 2, (B,), generator=g)) for _ in range(4)]
times = []; cpus = []
for step in range(11):
    b = batches[step % 4]
    dist.barrier()
    t0 = time.perf_counter(); c0 = time.process_time()
    loss = ddp(**b).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0); cpus.append(time.process_time() - c0)
if rank == 0:
    json.dump(dict(variant=variant, times=times[1:], cpus=cpus[1:], loss=loss.item(),
                   threads=torch.get_num_threads()), open(out, "w"))
dist.destroy_process_group()
