# ruff: noqa  (spike script, kept as run)
# DeepSpeedCPUAdam (adamw_mode True/False) vs torch fused AdamW: same params and grads, 3 steps.
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

torch.manual_seed(0)
ws = [torch.randn(1000, 100) for _ in range(2)]
gs = [[torch.randn(1000, 100) * 1e-3 for _ in range(2)] for _ in range(3)]


def run(make):
    ps = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = make(
        [{"params": [ps[0]], "weight_decay": 0.01}, {"params": [ps[1]], "weight_decay": 0.0}]
    )
    for g in gs:
        for p, gg in zip(ps, g):
            p.grad = gg.clone()
        opt.step()
    return ps


a = run(lambda g: torch.optim.AdamW(g, lr=5e-5, weight_decay=0.01, fused=True))
for mode in (True, False):
    b = run(lambda g: DeepSpeedCPUAdam(g, lr=5e-5, weight_decay=0.01, adamw_mode=mode))
    for i in range(2):
        d = (b[i] - a[i]).abs().max().item()
        upd = (a[i] - ws[i]).abs().max().item()
        print(f"adamw_mode={mode} group {i}: max|diff| {d:.3g}, max update {upd:.3g}")
