"""Quantized tiny checkpoints: a tiny checkpoint's routed experts in a quantized format, and its dequantized twin.

The quantized checkpoint stores its routed experts as the format's checkpoints do (names,
dtypes, scale shapes that SGLang's method loads) and every other module unquantized
(``modules_to_not_convert``), so it runs where only the experts' format is in question. The
twin is the same checkpoint with each routed expert replaced by its dequantized values:
stock SGLang serving the twin computes what FreeToken computes from the quantized experts.

    python -m freetoken_sglang.tiny_quant --src TINY_DIR --out FP8_DIR --twin TWIN_DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
from typing import Dict, Optional, Tuple

import torch

from freetoken_sglang.experts.formats import E2M1_VALUES, dequantize_nvfp4

#: A routed expert's projection weight in the per-expert checkpoint layout of every family.
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
FP8_MAX = 448.0


def fp8_block_quantize(w: torch.Tensor, block: Tuple[int, int],
                       pow2: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` as float8_e4m3fn codes and fp32 ``weight_scale_inv [ceil(R/bn),
    ceil(C/bk)]`` (one scale per ``bn x bk`` block, its amax mapped to at most 448), as
    DeepSeek-V3's FP8 checkpoints store a linear weight; ``codes * scale`` (per block)
    dequantizes it. ``pow2`` rounds each scale up to a power of two (as UE8M0 scales are), so
    every dequantized value is exact in BF16 and FP16 too."""
    bn, bk = block
    r, c = w.shape
    nr, nc = -(-r // bn), -(-c // bk)
    padded = torch.zeros(nr * bn, nc * bk, dtype=torch.float32)
    padded[:r, :c] = w.float()
    blocks = padded.view(nr, bn, nc, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nr * bn, nc * bk)[:r, :c].contiguous(), scale.contiguous()


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """fp32 values of ``fp8_block_quantize``'s output, by the format's definition."""
    bn, bk = block
    r, c = q.shape
    s = scale.repeat_interleave(bn, 0)[:r].repeat_interleave(bk, 1)[:, :c]
    return q.float() * s


def _not_converted(keys) -> list:
    """Every module but the routed experts (attention, shared experts, dense MLPs, router)."""
    names = set()
    for k in keys:
        if not k.endswith(".weight") or EXPERT_WEIGHT.search(k):
            continue
        mod = k[: -len(".weight")]
        if any(s in mod for s in ("embed_tokens", "lm_head", "norm")):
            continue
        names.add(mod)
        m = re.match(r"(.*\.(self_attn|linear_attn))\.", k)
        if m:
            names.add(m.group(1))
    return sorted(names)


def write_fp8_block(src: str, out: str, twin: str, block: Tuple[int, int] = (16, 16)) -> Tuple[str, str]:
    """Write ``src``'s FP8-block checkpoint to ``out`` and its dequantized twin to ``twin``.

    Args:
        src: a tiny checkpoint (``tiny_models.build_tiny_checkpoint``), per-expert weights.
        block: ``weight_block_size [bn, bk]``; bn must divide the experts' intermediate size
            (SGLang's ``Fp8MoEMethod`` requires it).

    Returns:
        ``(out, twin)``. Both are rebuilt only when ``src`` or ``block`` changed.
    """
    stamp, tensors = _stamp_and_tensors(src, out, twin, {"block": list(block)})
    if tensors is None:
        return out, twin
    quant, deq = {}, {}
    for k, t in tensors.items():
        if EXPERT_WEIGHT.search(k):
            q, s = fp8_block_quantize(t, block)
            quant[k] = q
            quant[k[: -len("weight")] + "weight_scale_inv"] = s
            deq[k] = fp8_block_dequantize(q, s, block).to(t.dtype)
        else:
            quant[k] = deq[k] = t
    _write_pair(src, out, twin, quant, deq, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block), "modules_to_not_convert": _not_converted(tensors),
    }, stamp)
    return out, twin


def _stamp_and_tensors(src: str, out: str, twin: str, what: dict):
    """``(stamp, tensors)``: the stamp of ``src`` and ``what``, and ``src``'s tensors, or None
    for them when ``out`` and ``twin`` already carry that stamp (nothing to rebuild)."""
    from safetensors.torch import load_file

    stamp = json.dumps({"src": os.path.abspath(src), **what,
                        "mtime": os.path.getmtime(os.path.join(src, "config.json"))})
    if all(_read(os.path.join(d, "freetoken_quant.json")) == stamp for d in (out, twin)):
        return stamp, None
    tensors: Dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        tensors.update(load_file(f))
    return stamp, tensors


def _write_pair(src: str, out: str, twin: str, quant: Dict[str, torch.Tensor],
                deq: Dict[str, torch.Tensor], quantization_config: dict, stamp: str) -> None:
    """Write the quantized checkpoint (``src``'s config plus ``quantization_config``) and its
    twin, each with ``src``'s other files and the ``stamp`` that marks them up to date."""
    from safetensors.torch import save_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for d, ts, cfg in ((out, quant, {**config, "quantization_config": quantization_config}),
                       (twin, deq, config)):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if not f.endswith(".safetensors") and f not in ("config.json", "freetoken_tiny.json",
                                                            "model.safetensors.index.json"):
                p = os.path.join(src, f)
                if os.path.isfile(p):
                    shutil.copy(p, d)
        save_file({k: v.contiguous() for k, v in ts.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(d, "freetoken_quant.json"), "w") as f:
            f.write(stamp)


# ---- MXFP4 (GPT-OSS's checkpoints: e2m1 pairs per byte, one e8m0 scale per 32 values) -------

#: GPT-OSS's fused expert tensors (``[E, in, out]`` in a BF16/FP32 checkpoint).
GPT_OSS_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
E2M1 = E2M1_VALUES[:8]  # the magnitudes


def mxfp4_quantize(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K % 32 == 0) as MXFP4: uint8 ``blocks [..., K/32, 16]`` (two e2m1 codes
    per byte, the even element in the low nibble) and uint8 e8m0 ``scales [..., K/32]``
    (2^(s - 127), the smallest power of two that maps the block's amax to at most 6), as
    GPT-OSS's ``*_proj_blocks`` / ``*_proj_scales`` store them. Magnitudes round to the
    nearest e2m1 value (ties to the larger). (SGLang 0.5.17's ``MXFP4QuantizeUtil.quantize``
    raises a TypeError when it builds its result, so it cannot serve here.)"""
    k = w.shape[-1]
    v = w.float().reshape(*w.shape[:-1], k // 32, 32)
    amax = v.abs().amax(dim=-1, keepdim=True)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127))
    mag = (v / torch.exp2(exp)).abs()
    grid = torch.tensor(E2M1)
    idx = (mag.unsqueeze(-1) - grid).abs().flip(-1).argmin(dim=-1)
    code = (7 - idx).to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8).contiguous()


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., K]`` values of ``mxfp4_quantize``'s output (SGLang's
    ``MXFP4QuantizeUtil.dequantize``)."""
    from sglang.srt.layers.quantization.mxfp4_tensor import MXFP4QuantizeUtil

    out = MXFP4QuantizeUtil.dequantize(blocks, torch.float32, scales, [32])
    return out.reshape(*blocks.shape[:-2], -1)


def write_mxfp4(src: str, out: str, twin: str) -> Tuple[str, str]:
    """Write the MXFP4 checkpoint of a tiny GPT-OSS checkpoint ``src`` to ``out`` and its
    dequantized twin to ``twin``.

    ``out`` stores each layer's experts as GPT-OSS's MXFP4 checkpoints do
    (``gate_up_proj_blocks [E, 2I, H/32, 16]``, ``gate_up_proj_scales [E, 2I, H/32]``,
    ``down_proj_blocks [E, H, I/32, 16]``, ``down_proj_scales [E, H, I/32]``, biases as
    they are) with ``quantization_config`` ``{"quant_method": "mxfp4"}``. In ``twin`` the
    expert weights are those values dequantized (``[E, in, out]``) and the expert biases are
    rounded to BF16, as SGLang's ``Mxfp4MoEMethod`` stores them.

    Returns:
        ``(out, twin)``, rebuilt only when ``src`` changed.
    """
    stamp, tensors = _stamp_and_tensors(src, out, twin, {"format": "mxfp4"})
    if tensors is None:
        return out, twin
    quant, deq = {}, {}
    for k, t in tensors.items():
        m = GPT_OSS_EXPERTS.search(k)
        if m is None:
            quant[k] = deq[k] = t
        elif m.group(2):  # a bias: kept, in BF16 as SGLang's MXFP4 method holds it
            quant[k] = t
            deq[k] = t.to(torch.bfloat16).to(t.dtype)
        else:
            blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # [E, out, in]
            quant[k + "_blocks"] = blocks.view(*blocks.shape[:-1], 16)
            quant[k + "_scales"] = scales
            deq[k] = mxfp4_dequantize(blocks, scales).transpose(1, 2).to(t.dtype)
    _write_pair(src, out, twin, quant, deq, {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}, stamp)
    return out, twin


# ---- NVFP4 (ModelOpt FP4: e2m1 pairs per byte, an e4m3 scale per 16, an fp32 scale_2) ----

E4M3_MAX = 448.0


def nvfp4_quantize(w: torch.Tensor, amax: Optional[float] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [R, C]`` (C % 16 == 0) as ModelOpt's NVFP4 checkpoints store a linear weight:
    uint8 ``weight [R, C/2]`` (two e2m1 codes per byte, the even column in the low nibble),
    float8_e4m3fn ``weight_scale [R, C/16]`` and fp32 ``weight_scale_2 []``, so that a value
    is ``e2m1 * weight_scale * weight_scale_2``. ``weight_scale_2`` is a power of two (the
    smallest that maps the tensor's amax to at most 6 * 448), so every dequantized value is
    exact in BF16; magnitudes round to the nearest e2m1 value (ties to the larger). ``amax``
    (default ``w``'s) sets ``weight_scale_2``: one for the gate and up projections of an
    expert, as SGLang's Marlin path expects. ``experts.formats.dequantize_nvfp4`` gives the
    values back."""
    r, c = w.shape
    v = w.float().reshape(r, c // 16, 16)
    amax = max(float(v.abs().max()) if amax is None else amax, 1e-12)
    scale_2 = torch.exp2(torch.ceil(torch.log2(torch.tensor(amax / (6.0 * E4M3_MAX)))))
    block = (v.abs().amax(dim=-1) / 6.0 / scale_2).clamp(max=E4M3_MAX)
    scale = block.to(torch.float8_e4m3fn)
    step = scale.float() * scale_2
    step = torch.where(step > 0, step, torch.ones_like(step))
    mag = (v / step.unsqueeze(-1)).abs()
    grid = torch.tensor(E2M1)
    idx = (mag.unsqueeze(-1) - grid).abs().flip(-1).argmin(dim=-1)
    code = (7 - idx).to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)
    code = code.reshape(r, c)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), scale.contiguous(), scale_2.float().reshape(())


def write_nvfp4(src: str, out: str, twin: str) -> Tuple[str, str]:
    """Write ``src``'s NVFP4 checkpoint to ``out`` and its dequantized twin to ``twin``.

    ``out`` stores each routed expert projection as ModelOpt's NVFP4 checkpoints do
    (``weight`` uint8 ``[R, C/2]``, ``weight_scale`` float8_e4m3fn ``[R, C/16]``,
    ``weight_scale_2`` and ``input_scale`` fp32 scalars) with ``quantization_config``
    ``{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": [every
    other module]}``; in ``twin`` those weights are their dequantized values. The gate and
    up projections of an expert share one ``weight_scale_2`` and one ``input_scale``.

    Args:
        src: a tiny checkpoint (``tiny_models.build_tiny_checkpoint``), per-expert weights.

    Returns:
        ``(out, twin)``, rebuilt only when ``src`` changed.
    """
    stamp, tensors = _stamp_and_tensors(src, out, twin, {"format": "nvfp4", "shared": 1})
    if tensors is None:
        return out, twin
    quant, deq = {}, {}
    for k, t in tensors.items():
        m = EXPERT_WEIGHT.search(k)
        if m:
            other = {"gate_proj": "up_proj", "up_proj": "gate_proj", "w1": "w3", "w3": "w1"}
            pair = [t] + ([tensors[k[:m.start(1)] + other[m.group(1)] + k[m.end(1):]]]
                          if m.group(1) in other else [])
            q, s, s2 = nvfp4_quantize(t, amax=max(float(x.abs().max()) for x in pair))
            base = k[: -len("weight")]
            # one input scale per expert input (gate and up share theirs), distinct per expert
            e = int(re.search(r"\.experts\.(\d+)\.", k).group(1))
            down = m.group(1) in ("down_proj", "w2")
            quant.update({k: q, base + "weight_scale": s, base + "weight_scale_2": s2,
                          base + "input_scale": torch.tensor(0.5 + e / 64 + down / 4)})
            deq[k] = dequantize_nvfp4(q[None], s[None], s2[None], t.dtype)[0]
        else:
            quant[k] = deq[k] = t
    _write_pair(src, out, twin, quant, deq, {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
        "ignore": _not_converted(tensors) + ["lm_head"]}, stamp)
    return out, twin


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--twin", required=True)
    p.add_argument("--block", default="16,16", help="weight_block_size bn,bk")
    a = p.parse_args(argv)
    bn, bk = (int(x) for x in a.block.split(","))
    print(*write_fp8_block(a.src, a.out, a.twin, (bn, bk)))


if __name__ == "__main__":
    main()
