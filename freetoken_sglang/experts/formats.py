"""Expert formats: per SGLang quantization method, the banks of one expert and how SGLang's MoE runner reads them.

A format entry says which SGLang ``FusedMoEMethodBase`` it takes over, whether a given instance
of it is served (``supports``), the banks of one expert (weights, scales, biases, with
SGLang's own names, shapes and dtypes), the quantization arguments of SGLang's Triton
fused-MoE kernels over slot banks, and the float weights the format's definition gives (for
SGLang's native torch MoE on the CPU engine). The pool, the fills and the slot banks only
see banks; adding a format is adding an entry to ``FORMATS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from freetoken_sglang.experts.pool import BankSpec, bank_specs_for_layer


@dataclass(frozen=True)
class TritonQuant:
    """The quantization arguments of SGLang's Triton fused-MoE sequence
    (``_prepare_fused_moe_run`` / ``_fused_moe_kernel_sequence`` in 0.5.17), with bank names
    in place of the scale tensors."""

    use_fp8_w8a8: bool = False
    block_shape: Optional[Tuple[int, int]] = None
    w1_scale: Optional[str] = None
    w2_scale: Optional[str] = None
    #: For a format SGLang's Triton kernels cannot read (MXFP4, NVFP4 on SGLang 0.5.17):
    #: ``(slot_banks, rows [n], dtype) -> (w13 [n, R, H], w2 [n, H, I])``, the experts at
    #: slot ``rows`` dequantized by the format's definition, which the unquantized kernels
    #: then read (``execute/slot_moe.py``).
    dequantize_rows: Optional[Callable] = None
    #: FP4 banks (MXFP4, NVFP4: ``{w13,w2}_weight`` packed e2m1 codes, ``_weight_scale`` and
    #: NVFP4's ``_weight_scale_2``), which ``kernels/fp4_moe.py`` also reads directly for
    #: decode-sized calls (``execute/slot_moe.py``).
    fp4: bool = False

    @property
    def dequantized(self) -> bool:
        return self.dequantize_rows is not None

    def kernel_kwargs(self, slot_banks: Dict[str, torch.Tensor]) -> dict:
        """The kwargs both SGLang functions take, with the scales read from ``slot_banks``."""
        return dict(
            use_fp8_w8a8=self.use_fp8_w8a8,
            use_int8_w8a8=False,
            use_int8_w8a16=False,
            use_int4_w4a16=False,
            per_channel_quant=False,
            block_shape=list(self.block_shape) if self.block_shape else None,
        ), dict(
            w1_scale=slot_banks[self.w1_scale] if self.w1_scale else None,
            w2_scale=slot_banks[self.w2_scale] if self.w2_scale else None,
        )


@dataclass(frozen=True)
class ExpertFormat:
    """One entry of ``FORMATS``.

    Attributes:
        label: the name logs, stats and errors use (``"fp8_block"``).
        method: ``module:qualname`` of the SGLang method whose ``create_weights`` FreeToken
            takes over for this format.
        quantizations: the SGLang quantization config names (``QuantizationConfig.get_name``)
            whose MoE layers this format may serve.
        supports: ``base_method -> None`` when served, else a one-line reason.
        banks: ``(base_method, layer, num_experts, hidden, inter, params_dtype, with_bias) ->
            {bank name: BankSpec}``: the banks of one expert, as the SGLang method registers
            them (``[E, *spec.shape]`` parameters named as the banks).
        triton: ``base_method -> TritonQuant``, or None where the format cannot run over
            GPU cache slots (on a GPU it is then served only with ``--freetoken-backend
            cpu``).
        dequantize: ``(base_method, {bank: rows [n, ...]}, dtype) -> (w13 [n, R, H],
            w2 [n, H, I])`` in ``dtype``, by the format's definition.
        executor_kwargs: ``base_method -> kwargs`` of ``CpuExpertExecutor`` for this format.
        initial_values: ``(bank, value)`` pairs of the values SGLang's method initializes its
            parameters to where they are not 0 (e.g. MXFP4's scales, 127 = 2^0): where SGLang
            pads the experts beyond the checkpoint's sizes, the pool starts from them.
    """

    label: str
    method: str
    quantizations: Tuple[str, ...]
    supports: Callable
    banks: Callable
    triton: Callable
    dequantize: Callable
    executor_kwargs: Callable
    initial_values: Tuple[Tuple[str, float], ...] = ()

    def check_banks(self, base_method, layer, params: Dict[str, torch.Tensor], num_experts: int,
                    hidden: int, inter: int, params_dtype: torch.dtype,
                    with_bias: bool) -> Dict[str, BankSpec]:
        """The banks of one expert, after checking that the parameters SGLang's method
        registered (``params``, on the meta device) are exactly the format's banks.

        Raises:
            UnsupportedModelError: the method is not served in this configuration, or it
                registered other parameters, shapes or dtypes than the format describes.
        """
        from freetoken_sglang.families import UnsupportedModelError

        reason = self.supports(base_method)
        if reason:
            raise UnsupportedModelError(f"--enable-freetoken ({self.label} experts): {reason}")
        want = self.banks(base_method, layer, num_experts, hidden, inter, params_dtype, with_bias)
        got = {
            n: BankSpec(tuple(p.shape[1:]), p.dtype)
            for n, p in params.items()
            if p.dim() >= 1 and p.shape[0] == num_experts
        }
        if got != want or len(got) != len(params):
            shapes = {n: (list(p.shape), str(p.dtype)) for n, p in params.items()}
            raise UnsupportedModelError(
                f"--enable-freetoken ({self.label} experts): {type(base_method).__name__} "
                f"registered {shapes}, not the {num_experts} x {want} banks this format serves"
            )
        return want


def _per_projection(dequantize: Callable, *banks: str) -> Callable:
    """An entry's ``dequantize`` that applies ``dequantize(*bank rows, dtype)`` to the w13
    banks, then the w2 banks, named ``w13_`` / ``w2_`` + each of ``banks``."""
    return lambda base_method, rows, dtype: tuple(
        dequantize(*(rows[f"{proj}_{b}"] for b in banks), dtype) for proj in ("w13", "w2"))


# ---- unquantized (BF16 / FP16 / FP32 checkpoints) ------------------------------------------

def _unquant_banks(base_method, layer, num_experts, hidden, inter, params_dtype, with_bias):
    return bank_specs_for_layer(
        hidden_size=hidden,
        intermediate_size=inter,
        dtype=params_dtype,
        is_gated=layer.moe_runner_config.is_gated,
        with_bias=with_bias,
    )


def _unquant_supports(base_method) -> Optional[str]:
    if getattr(base_method, "use_triton_kernels", False):
        return ("the triton_kernels MoE runner (transposed expert layouts) is not served; "
                "use --moe-runner-backend triton")
    return None


UNQUANTIZED = ExpertFormat(
    label="unquantized",
    method="sglang.srt.layers.quantization.unquant:UnquantizedFusedMoEMethod",
    quantizations=(),
    supports=_unquant_supports,
    banks=_unquant_banks,
    triton=lambda base_method: TritonQuant(),
    dequantize=_per_projection(lambda w, dtype: w.to(dtype), "weight"),
    executor_kwargs=lambda base_method: {},
)


# ---- FP8 e4m3 with block scales (DeepSeek-V3, Qwen3-FP8) -----------------------------------

def _fp8_supports(base_method) -> Optional[str]:
    cfg = base_method.quant_config
    if not cfg.is_checkpoint_fp8_serialized:
        return ("online FP8 quantization of a BF16 checkpoint (--quantization fp8) is not "
                "served; serve the BF16 checkpoint unquantized or an FP8 checkpoint")
    if not getattr(base_method, "block_quant", False):
        return ("FP8 without weight_block_size (per-tensor or per-channel scales) is not "
                "served yet; FP8 with block scales is")
    if getattr(cfg, "use_mxfp8", False) or getattr(base_method, "is_fp4_expert", False):
        return "MXFP8 and FP4 experts inside an FP8 config are not served yet"
    if cfg.activation_scheme != "dynamic":
        return (f"FP8 activation_scheme {cfg.activation_scheme!r} is not served yet; "
                "block-scaled checkpoints use 'dynamic'")
    return None


def _fp8_banks(base_method, layer, num_experts, hidden, inter, params_dtype, with_bias):
    bn, bk = base_method.quant_config.weight_block_size
    # Fp8MoEMethod.create_fp8_moe_weight_ (block quant; it requires inter % bn == 0)
    f8 = torch.float8_e4m3fn
    specs = {
        "w13_weight": BankSpec((2 * inter, hidden), f8),
        "w2_weight": BankSpec((hidden, inter), f8),
    }
    if with_bias:
        specs["w13_weight_bias"] = BankSpec((2 * inter,), torch.float32)
        specs["w2_weight_bias"] = BankSpec((hidden,), torch.float32)
    specs["w13_weight_scale_inv"] = BankSpec((2 * -(-inter // bn), -(-hidden // bk)),
                                             torch.float32)
    specs["w2_weight_scale_inv"] = BankSpec((-(-hidden // bn), -(-inter // bk)), torch.float32)
    return specs


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int],
                         dtype: torch.dtype) -> torch.Tensor:
    """``w [n, R, C]`` float8_e4m3fn times ``scale_inv [n, ceil(R/bn), ceil(C/bk)]`` fp32,
    one scale per ``bn x bk`` block, in ``dtype`` (SGLang's own ``block_quant_dequant``,
    ``layers/quantization/fp8_utils.py``)."""
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    return block_quant_dequant(w, scale_inv, list(block), dtype)


def _fp8_dequantize(base_method, rows, dtype):
    block = tuple(base_method.quant_config.weight_block_size)
    return (
        dequantize_fp8_block(rows["w13_weight"], rows["w13_weight_scale_inv"], block, dtype),
        dequantize_fp8_block(rows["w2_weight"], rows["w2_weight_scale_inv"], block, dtype),
    )


FP8_BLOCK = ExpertFormat(
    label="fp8_block",
    method="sglang.srt.layers.quantization.fp8:Fp8MoEMethod",
    quantizations=("fp8",),
    supports=_fp8_supports,
    banks=_fp8_banks,
    triton=lambda base_method: TritonQuant(
        use_fp8_w8a8=True,
        block_shape=tuple(base_method.quant_config.weight_block_size),
        w1_scale="w13_weight_scale_inv",
        w2_scale="w2_weight_scale_inv",
    ),
    dequantize=_fp8_dequantize,
    executor_kwargs=lambda base_method: {
        "block_shape": tuple(base_method.quant_config.weight_block_size)
    },
)


def _fp4_rows(with_scale_2: bool) -> Callable:
    """A ``TritonQuant.dequantize_rows`` for FP4 banks ``{w13,w2}_weight``,
    ``_weight_scale`` (and ``_weight_scale_2``): the Triton kernel of ``kernels/fp4.py``."""

    def rows(slot_banks, slot_rows, dtype):
        from freetoken_sglang.kernels.fp4 import dequantize_fp4_rows

        return tuple(
            dequantize_fp4_rows(slot_banks[f"{p}_weight"], slot_banks[f"{p}_weight_scale"],
                                slot_banks[f"{p}_weight_scale_2"] if with_scale_2 else None,
                                slot_rows, dtype)
            for p in ("w13", "w2"))

    return rows


#: e2m1 values by code (bit 3 the sign), as MXFP4 and NVFP4 define them.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
               -4.0, -6.0)

_E2M1_PAIRS: Dict[torch.device, torch.Tensor] = {}


def e2m1_pairs(device) -> torch.Tensor:
    """fp32 ``[256, 2]``: the two e2m1 values of a byte (low nibble first), on ``device``,
    built once per device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    table = _E2M1_PAIRS.get(device)
    if table is None:
        v = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        codes = torch.arange(256)
        table = torch.stack((v[codes & 0xF], v[codes >> 4]), dim=-1).to(device)
        _E2M1_PAIRS[device] = table
    return table


# ---- MXFP4 (GPT-OSS: e2m1 pairs per byte, e8m0 scales per 32, BF16 biases) ---------------

def _mxfp4_supports(base_method) -> Optional[str]:
    for flag, name in (("use_marlin", "marlin"), ("use_flashinfer", "flashinfer_mxfp4"),
                       ("use_deep_gemm", "deep_gemm"), ("use_triton_kernels", "triton_kernel")):
        if getattr(base_method, flag, False):
            return (f"SGLang's MoE runner backend for it is {name}, which repacks MXFP4 "
                    "experts at load and is not served; pass --moe-runner-backend triton")
    return None


def _mxfp4_banks(base_method, layer, num_experts, hidden, inter, params_dtype, with_bias):
    """Mxfp4MoEMethod.create_weights' banks (it always registers the BF16 biases outside
    ROCm). It pads I (and H) for some kernels (triton_kernels installed, SM100, aiter):
    refused, since a fill would move the padding and the C executor reads unpadded rows."""
    from freetoken_sglang.families import UnsupportedModelError

    padded = (getattr(base_method, "hidden_size", hidden),
              getattr(base_method, "intermediate_size_per_partition", inter))
    if padded != (hidden, inter):
        raise UnsupportedModelError(
            f"--enable-freetoken (mxfp4 experts): SGLang's Mxfp4MoEMethod pads the experts "
            f"(H, I) = {(hidden, inter)} to {padded} for its kernels here, which FreeToken "
            "does not serve; experts whose sizes need no padding (e.g. GPT-OSS's 2880) are")
    u8 = torch.uint8
    return {
        "w13_weight": BankSpec((2 * inter, hidden // 2), u8),
        "w13_weight_scale": BankSpec((2 * inter, hidden // 32), u8),
        "w13_weight_bias": BankSpec((2 * inter,), torch.bfloat16),
        "w2_weight": BankSpec((hidden, inter // 2), u8),
        "w2_weight_scale": BankSpec((hidden, inter // 32), u8),
        "w2_weight_bias": BankSpec((hidden,), torch.bfloat16),
    }


def dequantize_mxfp4(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w [n, R, C/2]`` uint8 (two e2m1 codes per byte, low nibble first) times ``2^(scale -
    127)``, ``scale [n, R, C/32]`` uint8 e8m0, as ``[n, R, C]`` in ``dtype`` (SGLang's
    ``MXFP4QuantizeUtil.dequantize``, ``layers/quantization/mxfp4_tensor.py``). The GPU
    cache's kernel for it is ``kernels/fp4.py``."""
    from sglang.srt.layers.quantization.mxfp4_tensor import MXFP4QuantizeUtil

    n, r, half = w.shape
    blocks = w.reshape(n, r, half // 16, 16)
    out = MXFP4QuantizeUtil.dequantize(quantized_data=blocks, dtype=dtype, scale=scale,
                                       block_sizes=[32])
    return out.reshape(n, r, 2 * half)


MXFP4 = ExpertFormat(
    label="mxfp4",
    method="sglang.srt.layers.quantization.mxfp4:Mxfp4MoEMethod",
    quantizations=("mxfp4",),
    supports=_mxfp4_supports,
    banks=_mxfp4_banks,
    triton=lambda base_method: TritonQuant(dequantize_rows=_fp4_rows(with_scale_2=False),
                                            fp4=True),
    dequantize=_per_projection(dequantize_mxfp4, "weight", "weight_scale"),
    executor_kwargs=lambda base_method: {},
    initial_values=(("w13_weight_scale", 127), ("w2_weight_scale", 127)),  # _UE8M0_ONE
)


# ---- NVFP4 (ModelOpt FP4: e2m1 pairs per byte, e4m3 scales per 16, fp32 scale_2) --------

def _nvfp4_supports(base_method) -> Optional[str]:
    cfg = base_method.quant_config
    if getattr(cfg, "is_nvfp4_online", False) or not cfg.is_checkpoint_nvfp4_serialized:
        return ("online NVFP4 quantization is not served; serve an NVFP4 checkpoint "
                "(quant_algo NVFP4)")
    if cfg.group_size != 16:
        return f"NVFP4 with group_size {cfg.group_size} is not served; ModelOpt's is 16"
    if getattr(cfg, "is_awq", False):
        return "ModelOpt NVFP4_AWQ is not served yet; serve an NVFP4 checkpoint"
    return None


def _nvfp4_banks(base_method, layer, num_experts, hidden, inter, params_dtype, with_bias):
    """ModelOptNvFp4FusedMoEMethod.create_weights' banks (no biases). The input scales are
    banks too: the checkpoint has one per expert, and SGLang's W4A4 kernels read them (the C
    executor and SGLang's Marlin W4A16 path do not)."""
    from freetoken_sglang.families import UnsupportedModelError

    if with_bias:
        raise UnsupportedModelError(
            "--enable-freetoken (nvfp4 experts): SGLang's ModelOptNvFp4FusedMoEMethod has no "
            "expert biases, and this model's experts have them; serve it in BF16 or MXFP4")
    if hidden % 16 or inter % 16:
        raise UnsupportedModelError(
            f"--enable-freetoken (nvfp4 experts): (H, I) = {(hidden, inter)} are not multiples "
            "of NVFP4's 16-value scale blocks; serve this model in BF16 or FP8")
    shards = 2 if layer.moe_runner_config.is_gated else 1
    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    return {
        "w13_weight": BankSpec((shards * inter, hidden // 2), torch.uint8),
        "w2_weight": BankSpec((hidden, inter // 2), torch.uint8),
        "w13_weight_scale": BankSpec((shards * inter, hidden // 16), e4m3),
        "w2_weight_scale": BankSpec((hidden, inter // 16), e4m3),
        "w13_weight_scale_2": BankSpec((2,) if shards == 2 else (), f32),
        "w2_weight_scale_2": BankSpec((), f32),
        "w13_input_scale": BankSpec((shards,), f32),
        "w2_input_scale": BankSpec((), f32),
    }


def dequantize_nvfp4(w: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """``w [n, R, C/2]`` uint8 (two e2m1 codes per byte, low nibble first) times ``scale
    [n, R, C/16]`` float8_e4m3fn times ``scale_2`` fp32 (``[n]``, or ``[n, 2]``: the first
    and second halves of the rows, gate and up), as ``[n, R, C]`` in ``dtype``: ModelOpt's
    NVFP4 definition in fp32 (SGLang 0.5.17 has no torch dequantizer for it). The GPU
    cache's kernel for it is ``kernels/fp4.py``."""
    n, r, half = w.shape
    vals = e2m1_pairs(w.device)[w.int()].reshape(n, r, half // 8, 16)
    vals *= scale.float()[..., None]
    s2 = scale_2.float().reshape(n, -1)
    vals *= s2.repeat_interleave(r // s2.shape[1], dim=1)[..., None, None]
    return vals.reshape(n, r, 2 * half).to(dtype)


NVFP4 = ExpertFormat(
    label="nvfp4",
    method="sglang.srt.layers.quantization.modelopt_quant:ModelOptNvFp4FusedMoEMethod",
    quantizations=("modelopt_fp4",),
    supports=_nvfp4_supports,
    banks=_nvfp4_banks,
    triton=lambda base_method: TritonQuant(dequantize_rows=_fp4_rows(with_scale_2=True),
                                            fp4=True),
    dequantize=_per_projection(dequantize_nvfp4, "weight", "weight_scale", "weight_scale_2"),
    executor_kwargs=lambda base_method: {},
)


#: Every served format, by label.
FORMATS: Dict[str, ExpertFormat] = {f.label: f for f in (UNQUANTIZED, FP8_BLOCK, MXFP4, NVFP4)}
#: SGLang quantization names some format serves.
QUANTIZATIONS = frozenset(q for f in FORMATS.values() for q in f.quantizations)


def format_for_method(base_method) -> Optional[ExpertFormat]:
    """The entry whose ``method`` is ``base_method``'s class, or None."""
    cls = type(base_method)
    name = f"{cls.__module__}:{cls.__qualname__}"
    for fmt in FORMATS.values():
        if fmt.method == name:
            return fmt
    return None
