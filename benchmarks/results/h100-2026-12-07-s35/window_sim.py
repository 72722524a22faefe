# Session 35, one-off (dev machine): a window of the W4 trace's decode rows replayed twice through
# the server's decision (decide_reference), the second pass counted: does a policy still miss on
# rows it has seen? T rows per step (env T, default 1), 48 layers mapped as the replay maps them,
# each layer call costed max(F_P + q S/B_P, F_H + c S/(B_H - B_P)) at the s35 BF16 server's
# rates. A model, not a measurement; benchmarks/policy_model.py is the maintained cost model.
# usage: PYTHONPATH=. python window_sim.py SLOTS STEPS POLICIES [WARM_STEPS [PERIOD_ROWS]]
#   e.g. window_sim.py 3072 260 fill,qstar,ret,reused 130 130   (130 rows, twice)
import sys, numpy as np, torch
from freetoken_sglang.cache.residency import ResidencyState, decide_reference, FILL_ALL
from freetoken_sglang.miss_policy import MissPolicy
d = np.load('benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz', allow_pickle=True)
ph, nt, ids = d['phase'], d['num_tokens'], d['ids']
starts = np.concatenate([[0], np.cumsum(nt)[:-1]])
rows = np.concatenate([np.arange(s, s+n) for s, n, p in zip(starts, nt, ph) if p == 1])
print('decode rows', len(rows))
L, E, k = 48, 128, 8
lmap = [l * ids.shape[1] // L for l in range(L)]
slots = int(sys.argv[1]); steps = int(sys.argv[2]); which = sys.argv[3].split(','); warm = int(sys.argv[4]) if len(sys.argv) > 4 else 0; period = int(sys.argv[5]) if len(sys.argv) > 5 else len(rows)
BP, BH, FP, FH, S = 47.19, 107.24, 8.9, 21.8, 9437184
fill_us = S / (BP * 1e3); cpu_us = S / ((BH - BP) * 1e3)
mk = lambda **kw: MissPolicy("qstar", (BP, BH), (FP, FH), S, **kw).decode_split
pols = {"fill": FILL_ALL, "qstar": mk(), "ret": mk(return_rule=True), "reused": mk(fill_reused=True),
        "admit": mk(admission=True)}
import dataclasses
pols["reuse-only"] = dataclasses.replace(mk(fill_reused=True), admit_reuse=True)
pols["reused-ret"] = mk(fill_reused=True, return_rule=True)
T = int(__import__('os').environ.get('T', '1'))
for name in which:
    split = pols[name]
    st = ResidencyState(L * E, slots, 'cpu')
    cnt = torch.zeros(5, L, dtype=torch.int64)
    t_us = 0.0
    for s in range(steps):
        r = [rows[(s * T + j) % period] for j in range(T)]
        if s == warm: cnt.zero_()
        for l in range(L):
            t = torch.from_numpy(ids[r, lmap[l], :k].astype(np.int64)).to(torch.int32).reshape(T, k)
            before = cnt[:, l].clone()
            decide_reference(st, cnt, l, E, t, torch.ones(T, k), torch.tensor([T]), split)
            dd = (cnt[:, l] - before).tolist(); q, c = dd[2], dd[4]
            if s >= warm:
                t_us += max(FP + q * fill_us if q else 0.0, FH + c * cpu_us if c else 0.0)
    u, h, f, ev, c = cnt.sum(1).tolist()
    print(name, slots, steps, 'reads', u, 'hits', h, 'fills', f, 'cpu', c, 'hit', round(h / u, 4), 'miss-ms', round(t_us/1e3,1), 'per-step-us', round(t_us/(steps-warm),1), flush=True)
