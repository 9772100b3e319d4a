# ruff: noqa  (spike script, kept as run)
# Bare DeepSpeed: ZeRO-2 + torch AdamW vs ZeRO-2 offload + DeepSpeedCPUAdam vs plain torch AdamW, same grads.
import os, sys, copy, torch, deepspeed, torch.distributed as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam

deepspeed.init_distributed(dist_backend="gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
V, H = int(os.environ.get("V", 1000)), 64
base = torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, H), torch.nn.Linear(H, 2))
x = torch.randint(0, V, (8 * ws, 16))
y = torch.randint(0, 2, (8 * ws,))


def loss_of(m, xs, ys):
    return torch.nn.functional.cross_entropy(m(xs).mean(1), ys)


def groups(m):
    ps = list(m.parameters())
    return [
        {"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.01},
        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
    ]


WD = float(os.environ.get("WD", 0.01))
LR = 5e-5


def ds_run(offload):
    m = copy.deepcopy(base)
    g = groups(m)
    for gg in g:
        if gg["weight_decay"]:
            gg["weight_decay"] = WD
    opt = (
        DeepSpeedCPUAdam(g, lr=LR, weight_decay=WD, adamw_mode=True)
        if offload
        else torch.optim.AdamW(g, lr=LR, weight_decay=WD)
    )
    zero = {
        "stage": 2,
        "reduce_bucket_size": 2**16,
        "allgather_bucket_size": 2**16,
        "contiguous_gradients": os.environ.get("CG", "1") == "1",
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 8 * ws,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    eng, *_ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    losses = []
    for s in range(3):
        xs, ys = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
        l = loss_of(eng, xs, ys)
        eng.backward(l)
        eng.step()
        losses.append(l.item())
    return losses, [p.detach().clone() for p in m.parameters()]


def torch_run():
    m = copy.deepcopy(base)
    opt = torch.optim.AdamW(groups(m), lr=LR, weight_decay=WD)
    for gg in opt.param_groups:
        if gg["weight_decay"]:
            gg["weight_decay"] = WD
    losses = []
    for s in range(3):
        opt.zero_grad()
        l = loss_of(m, x, y)
        l.backward()
        opt.step()
        with torch.no_grad():
            losses.append(
                sum(
                    loss_of(m, x[r * 8 : (r + 1) * 8], y[r * 8 : (r + 1) * 8]) for r in range(ws)
                ).item()
                / ws
            )
    return m


a_l, a_p = ds_run(False)
b_l, b_p = ds_run(True)
if rank == 0:
    print("ws", ws, "V", V, "WD", WD)
    print("zero2 losses   ", a_l)
    print("offload losses ", b_l)
    for (n, _), pa, pb in zip(base.named_parameters(), a_p, b_p):
        init = dict(base.named_parameters())[n]
        print(
            n,
            "max|zero2-offload|",
            (pa - pb).abs().max().item(),
            "max update",
            (pa - init).abs().max().item(),
        )
