"""The model families FreeToken serves, and which of their layers are MoE layers.

Each rule mirrors how SGLang 0.5.17's model class decides that a decoder layer builds a
``FusedMoE`` (named per family below), so the host pool can be laid out before the first
MoE layer is built. A model outside this table fails at start and names itself.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from freetoken_sglang.errors import RefusedError


class UnsupportedModelError(RefusedError):
    """The checkpoint's architecture or format is not served by FreeToken yet."""


def _all_layers(cfg) -> List[int]:
    return list(range(cfg.num_hidden_layers))


def _deepseek_layers(cfg) -> List[int]:
    # DeepseekV2DecoderLayer._is_layer_sparse (models/deepseek_v2.py)
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    return [
        i
        for i in range(cfg.num_hidden_layers)
        if cfg.n_routed_experts is not None
        and i >= cfg.first_k_dense_replace
        and i % freq == 0
    ]


def _glm4_moe_layers(cfg) -> List[int]:
    # Glm4MoeDecoderLayer._is_layer_sparse (models/glm4_moe.py)
    return [
        i
        for i in range(cfg.num_hidden_layers)
        if cfg.n_routed_experts is not None and i >= cfg.first_k_dense_replace
    ]


def _num_experts(cfg) -> int:
    for name in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = getattr(cfg, name, None)
        if value:
            return int(value)
    raise UnsupportedModelError("the model config names no routed-expert count")


# architecture -> (family, MoE layer rule). Qwen2-MoE and Qwen3-MoE make every layer
# sparse in SGLang 0.5.17 (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer), as do Mixtral and
# OLMoE.
SUPPORTED: Dict[str, tuple] = {
    "Qwen3MoeForCausalLM": ("Qwen3-MoE", _all_layers),
    "Qwen2MoeForCausalLM": ("Qwen2-MoE", _all_layers),
    "MixtralForCausalLM": ("Mixtral", _all_layers),
    "OlmoeForCausalLM": ("OLMoE", _all_layers),
    "DeepseekV2ForCausalLM": ("DeepSeek-V2", _deepseek_layers),
    "DeepseekV3ForCausalLM": ("DeepSeek-V3", _deepseek_layers),
    "Glm4MoeForCausalLM": ("GLM-4-MoE", _glm4_moe_layers),
    # Every GptOssDecoderLayer builds GptOssSparseMoeBlock (models/gpt_oss.py): expert biases,
    # the clamped swiglu with gemm1_alpha, interleaved gate/up rows.
    "GptOssForCausalLM": ("GPT-OSS", _all_layers),
    # Hybrid: gated DeltaNet layers interleaved with full attention (HYBRID below). Every
    # layer builds Qwen2MoeSparseMoeBlock (Qwen3HybridLinearDecoderLayer /
    # Qwen3_5LinearDecoderLayer set is_layer_sparse = True unconditionally).
    "Qwen3NextForCausalLM": ("Qwen3-Next", _all_layers),
    "Qwen3_5MoeForCausalLM": ("Qwen3.5-MoE", _all_layers),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3.5-MoE", _all_layers),
}

# Families whose recurrent layers keep a state per request (SGLang's hybrid machinery:
# HybridReqToTokenPool, the mamba radix-cache component); semantic anchors apply to them.
HYBRID = {"Qwen3-Next", "Qwen3.5-MoE"}


def text_config(hf_config):
    """The language model's config (a vision-language checkpoint nests it as text_config)."""
    get = getattr(hf_config, "get_text_config", None)
    return get() if get is not None else hf_config


def _quantization_config(hf_config):
    return getattr(text_config(hf_config), "quantization_config", None) or getattr(
        hf_config, "quantization_config", None)


def family_of(hf_config) -> tuple:
    """(family name, MoE layer rule) of the checkpoint.

    Raises:
        UnsupportedModelError: the architecture is not in ``SUPPORTED``, or the checkpoint's
            quantization is not served (``quantization_problem``).
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED:
            break
    else:
        raise UnsupportedModelError(
            f"--enable-freetoken does not support the architecture {archs or '(none)'} "
            f"yet; supported: {', '.join(sorted(SUPPORTED))}"
        )
    quant = _quantization_config(hf_config)
    if quant:
        problem = quantization_problem(quant)
        if problem:
            raise UnsupportedModelError(f"--enable-freetoken: {arch}: {problem}")
    return SUPPORTED[arch]


def quantization_problem(quant) -> Optional[str]:
    """Why a checkpoint's ``quantization_config`` is not served, or None when an expert
    format (``experts/formats.py``) serves it. Only the config is read here; the MoE layer's
    own method is checked again when it is built (``patches/moe_layer.py``)."""
    from freetoken_sglang.experts.formats import QUANTIZATIONS

    q = quant if isinstance(quant, dict) else getattr(quant, "to_dict", lambda: {})()
    algo = str(q.get("quant_algo") or "").upper()
    # SGLang reads a config with quant_algo and no quant_method as ModelOpt's
    method = q.get("quant_method") or ("modelopt" if algo else None)
    served = ", ".join(sorted(QUANTIZATIONS))
    if method == "modelopt":  # ModelOpt's config.json; SGLang picks its method by quant_algo
        if algo != "NVFP4":
            return (f"ModelOpt {algo or 'quantization'} experts are not served yet (ModelOpt "
                    "NVFP4 is); serve an NVFP4, FP8-block or BF16 checkpoint")
        method = "modelopt_fp4"
    if method not in QUANTIZATIONS:
        return (f"quantization {method!r} is not served yet (served: BF16, FP16, FP32 and "
                f"{served}); serve a checkpoint in one of those")
    if method == "fp8" and not q.get("weight_block_size"):
        return ("FP8 without weight_block_size (per-tensor scales) is not served yet; FP8 "
                "with block scales (e.g. [128, 128]) is")
    return None


def check_model_path(model_path: str, trust_remote_code: bool = False, revision=None) -> None:
    """Refuse an unsupported model from its config alone, before any process starts.

    A config that cannot be read here (e.g. a hub id with no network) is left to the check
    the scheduler makes when it loads the model (``FreeTokenRuntime``).

    Raises:
        UnsupportedModelError: as ``family_of``.
    """
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(
            model_path, trust_remote_code=trust_remote_code, revision=revision
        )
    except Exception:
        return
    family_of(hf_config)
    # ModelOpt's legacy hf_quant_config.json, which SGLang reads when config.json has none
    legacy = os.path.join(model_path, "hf_quant_config.json")
    if not _quantization_config(hf_config) and os.path.isfile(legacy):
        with open(legacy) as f:
            quant = json.load(f).get("quantization") or {}
        problem = quantization_problem({"quant_method": "modelopt", **quant})
        if problem:
            raise UnsupportedModelError(f"--enable-freetoken: {legacy}: {problem}")


def moe_layer_ids(hf_config) -> List[int]:
    """The transformer layer ids that build a ``FusedMoE``, in order."""
    _, rule = family_of(hf_config)
    return rule(text_config(hf_config))


def num_routed_experts(hf_config) -> int:
    """E: routed experts per MoE layer."""
    return _num_experts(text_config(hf_config))


def expert_intermediate_size(hf_config) -> int:
    """I: the routed experts' intermediate size (Mixtral and OLMoE use ``intermediate_size``)."""
    cfg = text_config(hf_config)
    return int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)


def top_k(hf_config) -> int:
    return int(text_config(hf_config).num_experts_per_tok)


def is_hybrid(hf_config) -> bool:
    """Whether the checkpoint is a hybrid (recurrent + attention) family (``HYBRID``)."""
    return family_of(hf_config)[0] in HYBRID

