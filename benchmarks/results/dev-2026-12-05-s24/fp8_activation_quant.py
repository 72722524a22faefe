"""Does FP8 activation quantization (SGLang's w8a8 block MoE on a GPU) alone move the greedy
tokens of gpu_equality.py's tiny FP8 DeepSeek-V3 at token 0-1, with margins like the H200 qstar
run's (Session 12: 0.06-2.87 nats)? transformers on the dequantized twin, 8 greedy tokens per
prompt, routed experts computed three ways: BF16 activations (the C executor's inputs), SGLang's
per-token-group (128) e4m3 quantization of the expert input and of the SiLU*up intermediate
(per_token_group_quant_fp8, as its Triton FP8 block MoE does), and fp32 throughout.
Run from the repository root: python benchmarks/results/dev-2026-12-05-s24/fp8_activation_quant.py"""
import sys, types, torch, torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from gpu_equality import PROMPTS
from freetoken_sglang.tiny_models import TinyShape, build_tiny_checkpoint
from freetoken_sglang.tiny_quant import write_fp8_block
from transformers import AutoModelForCausalLM

path = build_tiny_checkpoint("deepseek_v3", "/tmp/fp8act/deepseek_v3",
    TinyShape(hidden_size=256, head_dim=64, num_heads=4, num_kv_heads=2, num_layers=12,
              num_experts=16, top_k=4, moe_intermediate_size=128, kv_lora_rank=512), dtype="bfloat16")
q, twin = write_fp8_block(path, path + "-fp8", path + "-fp8-twin", block=(128, 128))

def fq(x, g=128):  # SGLang per_token_group_quant_fp8: scale = amax/448 per (token, 128 group)
    t, h = x.shape
    xg = x.float().view(t, h // g, g)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return ((xg / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).view(t, h)

def make_forward(mode):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            x = hidden_states[tok].float()
            if mode == "w8a8":
                x = fq(x)
            gu = x @ self.gate_up_proj[e].float().t()
            if mode != "fp32":
                gu = gu.bfloat16().float()
            g, u = gu.chunk(2, -1)
            h = F.silu(g) * u
            if mode != "fp32":
                h = h.bfloat16().float()
            if mode == "w8a8":
                h = fq(h)
            y = (h @ self.down_proj[e].float().t()) * top_k_weights[tok, pos, None].float()
            out.index_add_(0, tok, y)
        return out.to(hidden_states.dtype)
    return forward

def greedy(mode, n=8):
    m = AutoModelForCausalLM.from_pretrained(twin, torch_dtype=torch.bfloat16)
    m.eval()
    for mod in m.modules():
        if type(mod).__name__ == "DeepseekV3NaiveMoe":
            mod.forward = types.MethodType(make_forward(mode), mod)
    res = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            toks, margins = [], []
            for _ in range(n):
                lp = torch.log_softmax(m(ids).logits[0, -1].float(), -1)
                top = lp.topk(2)
                toks.append(int(top.indices[0])); margins.append(float(top.values[0] - top.values[1]))
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], 1)
            res.append((toks, margins))
    return res

runs = {mode: greedy(mode) for mode in ("bf16", "w8a8", "fp32")}
for other in ("w8a8", "fp32"):
    print(f"--- bf16 (exact weights, BF16 activations) against {other}")
    for i, ((ta, ma), (tb, _)) in enumerate(zip(runs["bf16"], runs[other])):
        d = next((j for j in range(len(ta)) if ta[j] != tb[j]), None)
        print(f"prompt {i}: first diff {d}, margin there {ma[d] if d is not None else '-'}; margins {[round(x, 3) for x in ma]}")
