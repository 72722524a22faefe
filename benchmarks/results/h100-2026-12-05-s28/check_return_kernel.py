"""GPU check: the decision kernel with the return rule compiles and matches the torch reference."""
import random, sys, torch
from freetoken_sglang.cache.residency import MissSplit, ResidencyState, decide_reference
from freetoken_sglang.kernels.residency import decide_triton
split = MissSplit(0.4, 1, 215.0, 145.0, 9.9, 19.9, return_rule=True)
rng = random.Random(1)
L, E, k, S = 4, 128, 8, 300
a, b = ResidencyState(L * E, S, "cpu"), ResidencyState(L * E, S, "cuda")
ca = torch.zeros(5, L, dtype=torch.int64); cb = ca.cuda()
bad = 0
for step in range(300):
    T = rng.choice([1, 4]); layer = step % L
    fav = [(layer * 7 + j) % E for j in range(12)]
    ids = torch.tensor([rng.sample(fav if rng.random() < 0.7 else range(E), k) for _ in range(T)], dtype=torch.int32)
    w = torch.rand(T, k); nv = torch.tensor([T], dtype=torch.int32)
    da = decide_reference(a, ca, layer, E, ids, w, nv, split, 1.0)
    db = decide_triton(b, cb, layer, E, ids.cuda(), w.cuda(), nv.cuda(), split, 1.0)
    if int(da.plan.count) != int(db.plan.count.cpu()) or int(da.cpu.count) != int(db.cpu.count.cpu()):
        bad += 1
print("counters ref", ca.sum(1).tolist(), "gpu", cb.sum(1).tolist(), "mismatched calls", bad,
      "rate ref", a.return_rate, "gpu", b.return_rate)
sys.exit(0)
