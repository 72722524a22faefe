"""Session 37: the share of layer calls with misses whose least recently used slot was hit since its fill (calm), replaying the W4 trace through decide_reference as policy_model.py does (q* with the useful admission; 20 warm steps, 100 counted). A model, not a measurement.

    PYTHONPATH=. python benchmarks/results/h100-2026-12-07-s37/calm_fraction.py
"""
import sys, numpy as np, torch
sys.path.insert(0,'benchmarks'); sys.path.insert(0,'.')
import policy_model as pm
from freetoken_sglang.cache.residency import ResidencyState, decide_reference
from freetoken_sglang.miss_policy import MissPolicy
from freetoken_sglang.observe.routing_trace import RoutingTrace
from freetoken_sglang.observe.routing_replay import layer_map
from servers import shape_config
cfg = shape_config("qwen3-30b-a3b", None); L,E = cfg["num_hidden_layers"], cfg["num_experts"]
tr = RoutingTrace.load("benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz")
ids = tr.ids[np.repeat(tr.phase == 1, tr.num_tokens)]
lmap = layer_map(tr.num_layers, L)
S=int(9*2**20)
pol = MissPolicy("qstar",(47.2,107.2),(8.9,21.8),3*cfg["hidden_size"]*cfg["moe_intermediate_size"]*2,True,False,False,admit_useful=True)
split=pol.decode_split
state = ResidencyState(L*E, L*E, "cpu"); state.make_all_resident()
for ratio in (0.5,0.25,0.1):
  state = pm.shrink(state, int(round(ratio*L*E)), E)
  for bs in (1,4):
    calm=thr=0
    counters=torch.zeros(5,L,dtype=torch.int64); w=torch.ones(bs,ids.shape[2]); nv=torch.tensor([bs],dtype=torch.int32)
    for step in range(120):
      rows=[(step*bs+i)%ids.shape[0] for i in range(bs)]
      block=torch.from_numpy(ids[rows].astype(np.int32))
      for layer in range(L):
        t=block[:,lmap[layer]].contiguous()
        res=state.layer_slots(layer,E); used=torch.zeros(E,dtype=torch.bool); used[t.long().flatten()]=True
        if (used & (res<0)).any() and step>=20:
          oldest=torch.div(state.key.min(),state.num_slots,rounding_mode="floor"); lru=torch.argmin(state.key)
          if oldest>state.filled_at[lru]: calm+=1
          else: thr+=1
        decide_reference(state,counters,layer,E,t,w,nv,split)
    print(ratio,bs,"calls with misses: calm",calm,"thrash",thr, flush=True)
