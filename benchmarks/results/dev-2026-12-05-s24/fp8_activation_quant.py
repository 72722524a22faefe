"""How far apart are SGLang's FP8 block MoE on a GPU and the C executor on the same FP8
experts? transformers on the dequantized twin of gpu_equality.py's tiny FP8 DeepSeek-V3 shape
(built here: its weights are not the H200 run's), 8 greedy tokens per prompt, the routed
experts computed as SGLang's Triton FP8 block MoE does (its expert input and SiLU*up
intermediate quantized to e4m3 per 128 values: sglang_per_token_group_quant_fp8 on CUDA, the
same math as per_token_group_quant_fp8; BF16 GEMM outputs), as the C executor does (BF16
input, fp32 sums, BF16 intermediate), and in fp32. Prints first differing tokens, the
reference's top-2 margin there, and KL at the first position.
Run from the repository root:
    python benchmarks/results/dev-2026-12-05-s24/fp8_activation_quant.py"""
import sys
import types

import torch
import torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from gpu_equality import PROMPTS
from freetoken_sglang.tiny_models import TinyShape, build_tiny_checkpoint
from freetoken_sglang.tiny_quant import write_fp8_block
from transformers import AutoModelForCausalLM

SHAPE = TinyShape(hidden_size=256, head_dim=64, num_heads=4, num_kv_heads=2, num_layers=12,
                  num_experts=16, top_k=4, moe_intermediate_size=128, kv_lora_rank=512)
path = build_tiny_checkpoint("deepseek_v3", "/tmp/fp8act/deepseek_v3", SHAPE, dtype="bfloat16")
q, twin = write_fp8_block(path, path + "-fp8", path + "-fp8-twin", block=(128, 128))


def fq(x, g=128):
    """SGLang's per-token-group FP8 quantization, dequantized: scale amax/448 per 128."""
    t, h = x.shape
    xg = x.float().view(t, h // g, g)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return ((xg / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).view(t, h)


def make_forward(mode):
    """Routed experts: "w8a8" as SGLang's FP8 block Triton MoE on a GPU (input and SiLU*up
    quantized per 128, BF16 GEMM outputs), "executor" as the C executor (BF16 input, fp32 sums,
    BF16 intermediate), "fp32" throughout."""
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
            if mode == "w8a8":
                gu = gu.bfloat16().float()
            g, u = gu.chunk(2, -1)
            h = F.silu(g) * u
            if mode != "fp32":
                h = h.bfloat16().float()
            if mode == "w8a8":
                h = fq(h)
            y = h @ self.down_proj[e].float().t()
            if mode == "w8a8":
                y = y.bfloat16().float()
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None].float())
        return out.to(hidden_states.dtype)
    return forward


def greedy(mode, n=8):
    """Greedy tokens, top-2 margins (nats) and the log-probabilities at the first position."""
    m = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.bfloat16)
    m.eval()
    for mod in m.modules():
        if type(mod).__name__ == "DeepseekV3NaiveMoe":
            mod.forward = types.MethodType(make_forward(mode), mod)
    res = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            toks, margins, first = [], [], None
            for _ in range(n):
                lp = torch.log_softmax(m(ids).logits[0, -1].float(), -1)
                first = lp if first is None else first
                top = lp.topk(2)
                toks.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], 1)
            res.append((toks, margins, first))
    return res


runs = {mode: greedy(mode) for mode in ("w8a8", "executor", "fp32")}
for ref, other in (("w8a8", "executor"), ("w8a8", "fp32"), ("executor", "fp32")):
    print(f"--- {other} against {ref} (margins and KL(ref || other) at the first position)")
    for i, ((ta, ma, la), (tb, _, lb)) in enumerate(zip(runs[ref], runs[other])):
        d = next((j for j in range(len(ta)) if ta[j] != tb[j]), None)
        kl = float((la.exp() * (la - lb)).sum())
        print(f"prompt {i}: first diff {d}, {ref}'s margin there "
              f"{round(ma[d], 3) if d is not None else '-'}; KL {kl:.3f}; {ref}'s tokens {ta}")
