# ruff: noqa  (spike script, kept as run)
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from harness import saved_tensors

pairs = [(a, b) for a, b in zip(sys.argv[1::2], sys.argv[2::2])]
for a, b in pairs:
    ta, tb = saved_tensors(Path(a)), saved_tensors(Path(b))
    assert ta.keys() == tb.keys(), set(ta) ^ set(tb)
    kinds = {}
    for k in ta:
        kind = k.split("/")[0] + ("/" + k.rsplit("/", 1)[1] if k.startswith("optim/") else "")
        d = (ta[k].double() - tb[k].double()).abs().max().item() if ta[k].numel() else 0.0
        s = kinds.setdefault(kind, [0, 0, 0.0])
        s[0] += 1
        s[1] += int(d == 0)
        s[2] = max(s[2], d)
    print(
        a.split("/")[3],
        "vs",
        b.split("/")[3],
        {k: f"{v[1]}/{v[0]} bit-equal, max|diff| {v[2]:.3g}" for k, v in kinds.items()},
    )
