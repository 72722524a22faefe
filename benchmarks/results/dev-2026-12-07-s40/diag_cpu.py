"""Classify the candidate's CPU runs in the model's bench sequence (dummy-ish trace)."""
import sys, collections
import numpy as np, torch
sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
import policy_model as pm
from freetoken_sglang.cache.residency import ResidencyState, decide_reference, valued_reuse, reuse_need
from freetoken_sglang.miss_policy import MissPolicy
from freetoken_sglang.observe.routing_replay import layer_map
from freetoken_sglang.observe.routing_trace import RoutingTrace
from servers import shape_config

trace_path = sys.argv[1]; ratio = float(sys.argv[2])
bw = (45.70, 95.17, 8.77, 18.71, 37.92, 76.87)
cfg = shape_config('qwen3-30b-a3b', None)
L, E, k = cfg['num_hidden_layers'], cfg['num_experts'], cfg['num_experts_per_tok']
tr = RoutingTrace.load(trace_path)
ids = tr.ids[np.repeat(tr.phase == 1, tr.num_tokens)][..., :k]
lmap = layer_map(tr.num_layers, L)
S = pm.expert_bytes(cfg)
pol = MissPolicy('qstar', (bw[4], bw[4] + bw[5]), bw[2:4], S, True, True, False,
                 admit_useful=True, fill_reused_valued=True, host_rates='beside')
split = pol.decode_split
print('need', reuse_need(split), 'ratio', split.fill_ratio)
stats = collections.Counter()
gaps = collections.defaultdict(list)
orig = pm.decide_reference
cpu_log = {}  # flat -> clock of cpu run
def wrapped(state, counters, layer, E_, ids_, w, nv, split_, *a):
    base = layer * E_
    used = torch.zeros(E_, dtype=torch.bool); used[ids_[: int(nv)].reshape(-1).long()] = True
    res = state.residency[base:base + E_]
    miss = used & (res < 0)
    Sn = state.num_slots
    oldest = int(torch.div(state.key.min(), Sn, rounding_mode='floor'))
    now = int(state.clock) + 1
    last = state.last_use[base:base + E_].clone()
    lru = int(torch.argmin(state.key)); calm = oldest > int(state.filled_at[lru])
    c0 = counters.clone()
    d = orig(state, counters, layer, E_, ids_, w, nv, split_, *a)
    n = int(d.cpu.count)
    cpu_e = set(int(x) - base for x in d.cpu.experts[:n].tolist())
    m = int(miss.sum())
    for e in range(E_):
        if not miss[e]:
            continue
        fl = base + e
        was_cpu = fl in cpu_log
        reused = int(last[e]) > oldest
        val = bool(valued_reuse(torch.tensor(now - oldest), torch.tensor(now - int(last[e])), split_))
        cls = ('calm' if calm else 'thrash') + ('/reused' if reused else '/new') + ('/val' if reused and val else '') + ('/prevcpu' if was_cpu else '')
        stats[cls + (' -> CPU' if e in cpu_e else ' -> fill')] += 1
        if reused and e in cpu_e:
            gaps['age/gap'].append((now - oldest) / max(1, now - int(last[e])))
        if e in cpu_e:
            cpu_log[fl] = now
        else:
            cpu_log.pop(fl, None)
    stats[f'm={m} c={n}'] += 1 if m else 0
    return d
pm.decide_reference = wrapped

state = ResidencyState(L * E, L * E, 'cpu'); state.make_all_resident()
for r in (0.5, 0.25):
    state = pm.shrink(state, int(round(r * L * E)), E)
    stats.clear(); gaps.clear(); cpu_log.clear()
    out = pm.run_bench_cell(ids, lmap, E, state, pol, {1: 224.27, 4: 439.11}, S, bw)
    print('ratio', r, [(o['bs'], round(o['tok_s'], 1), round(o['hit_rate'], 3), o['fills'], o['cpu']) for o in out])
    for kk, v in sorted(stats.items()):
        print('  ', kk, v)
    if gaps['age/gap']:
        g = np.array(gaps['age/gap']); print('   reused->cpu age/gap quantiles', np.quantile(g, [0, .25, .5, .75, 1]).round(2))
    if r == ratio: break
