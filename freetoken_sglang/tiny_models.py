"""Tiny random MoE checkpoints of every supported family, built locally with no model hub.

Used by the tests, the examples and the CPU smoke benchmarks. Each checkpoint is a
transformers ``save_pretrained`` directory (safetensors) with a byte-level BPE tokenizer
trained here with ``tokenizers`` and a ChatML chat template that knows the agent special
tokens (thinking, tool call, tool output, turn).

    python -m freetoken_sglang.tiny_models --family qwen3_moe --out /tmp/tiny-qwen3
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Callable, Dict

FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "gpt_oss",
)

# Gated DeltaNet + full attention (families.HYBRID).
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe")

# Special tokens of the chat template; the agent boundaries are the semantic anchors of
# paper §3.1.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}"
    "{%- elif message.content %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{ part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments if tc.function.arguments is string "
    "else tc.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

_CORPUS_WORDS = (
    "the expert cache holds a slot for each layer and expert the router picks top k "
    "experts for every token prefill streams whole layers over pcie while decode fills "
    "misses or runs them on the cpu agents call tools read files write patches think "
    "about the answer and reply to the user mail calendar meeting monday tuesday code "
    "python function class return value error test passes fails build install server "
    "request response latency throughput token model weight memory host device gpu cpu"
).split()


@dataclass(frozen=True)
class TinyShape:
    """Sizes of a tiny checkpoint. ``head_dim`` must be 64 or 128 on CUDA (SGLang's rotary
    fallback asserts on smaller ones); 16 keeps CPU runs fast. DeepSeek-V3 on CUDA needs
    ``kv_lora_rank`` 512, as the real model (SGLang's Triton MLA decode kernel failed to
    compile on the H200 with 64)."""

    hidden_size: int = 64
    moe_intermediate_size: int = 32
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 384
    init_std: float = 0.2
    kv_lora_rank: int = 0  # DeepSeek-V3's MLA latent width; 0: head_dim (CPU), 512 on CUDA


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE trained on a small synthetic corpus, as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = _CORPUS_WORDS
    corpus = [
        " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12))
        for i in range(400)
    ]
    corpus += ['{"name": "read_file", "arguments": {"path": "a.py"}}', "0123456789"]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _common(s: TinyShape, vocab: int, eos_id: int, pad_id: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=s.hidden_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=4096,
        initializer_range=s.init_std,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )


def _qwen3_moe(s, c):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **c,
        head_dim=s.head_dim,
        intermediate_size=s.moe_intermediate_size * 2,
        moe_intermediate_size=s.moe_intermediate_size,
        num_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _qwen2_moe(s, c):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **c,
        intermediate_size=s.moe_intermediate_size * 2,
        moe_intermediate_size=s.moe_intermediate_size,
        shared_expert_intermediate_size=s.moe_intermediate_size * 2,
        num_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _mixtral(s, c):
    from transformers import MixtralConfig

    return MixtralConfig(
        **c,
        head_dim=s.head_dim,
        intermediate_size=s.moe_intermediate_size,
        num_local_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
    )


def _olmoe(s, c):
    from transformers import OlmoeConfig

    c = dict(c)
    c["num_key_value_heads"] = s.num_heads  # SGLang's OLMoE k_norm spans all heads
    return OlmoeConfig(
        **c,
        intermediate_size=s.moe_intermediate_size,
        num_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
        norm_topk_prob=False,
    )


def _deepseek(s, c, v3: bool):
    from transformers import DeepseekV2Config, DeepseekV3Config

    cls = DeepseekV3Config if v3 else DeepseekV2Config
    c = dict(c)
    c["num_key_value_heads"] = s.num_heads
    extra = dict(
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc" if v3 else "group_limited_greedy",
        scoring_func="sigmoid" if v3 else "softmax",
        norm_topk_prob=bool(v3),
    )
    return cls(
        **c,
        **extra,
        intermediate_size=s.moe_intermediate_size * 2,
        moe_intermediate_size=s.moe_intermediate_size,
        n_routed_experts=s.num_experts,
        n_shared_experts=1,
        num_experts_per_tok=s.top_k,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        # On the CPU, SGLang's torch-native backend reads prefill keys from the MLA latent
        # cache ([kv_lora_rank + rope]), so kv_lora_rank = qk_nope_head_dim lines the shapes
        # up. The attention then differs from transformers' (compare with stock SGLang).
        kv_lora_rank=s.kv_lora_rank or s.head_dim,
        q_lora_rank=None,
        qk_nope_head_dim=s.head_dim,
        qk_rope_head_dim=s.head_dim,
        v_head_dim=s.head_dim,
        rope_scaling={
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )


def _glm4_moe(s, c):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        **c,
        head_dim=s.head_dim,
        intermediate_size=s.moe_intermediate_size * 2,
        moe_intermediate_size=s.moe_intermediate_size,
        n_routed_experts=s.num_experts,
        n_shared_experts=1,
        num_experts_per_tok=s.top_k,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        partial_rotary_factor=0.5,
        use_qk_norm=False,
    )


def _gpt_oss(s, c):
    from transformers import GptOssConfig

    # Sliding-window layers alternate with full attention; a window of 32 tokens is exceeded
    # by the tests' longer prompts. SGLang 0.5.17 hands its attention backends
    # ``sliding_window - 1`` (``get_attention_sliding_window_size``): its Triton decode then
    # attends to one key fewer than transformers once a sequence reaches the window (greedy
    # tokens parted there with a window of 8), so compare with transformers only within it.
    return GptOssConfig(
        **c,
        head_dim=s.head_dim,
        intermediate_size=s.moe_intermediate_size,
        num_local_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
        sliding_window=32,
    )


def _qwen3_next(s, c):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **c,
        head_dim=s.head_dim,
        intermediate_size=s.moe_intermediate_size * 2,
        moe_intermediate_size=s.moe_intermediate_size,
        shared_expert_intermediate_size=s.moe_intermediate_size,
        num_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        full_attention_interval=2,
        linear_num_value_heads=s.num_heads,
        linear_num_key_heads=s.num_kv_heads,
        linear_key_head_dim=s.head_dim,
        linear_value_head_dim=s.head_dim,
        linear_conv_kernel_dim=4,
    )


def _qwen3_5_moe(s, c):
    """The Qwen3.5-MoE text model (``Qwen3_5MoeForCausalLM``): gated full attention, Gemma
    norms, partial RoPE; its router always renormalizes the top-k (no norm_topk_prob)."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        **c,
        head_dim=s.head_dim,
        moe_intermediate_size=s.moe_intermediate_size,
        shared_expert_intermediate_size=s.moe_intermediate_size,
        num_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
        full_attention_interval=2,
        linear_num_value_heads=s.num_heads,
        linear_num_key_heads=s.num_kv_heads,
        linear_key_head_dim=s.head_dim,
        linear_value_head_dim=s.head_dim,
        linear_conv_kernel_dim=4,
    )


# config.json keys transformers does not write but SGLang 0.5.17's config class reads
# (Qwen3NextConfig.save_pretrained writes layer_types; SGLang derives them from this).
_EXTRA_CONFIG_KEYS = {
    "qwen3_next": {"full_attention_interval": 2},
    "qwen3_5_moe": {"full_attention_interval": 2},
    # SGLang 0.5.17 reads the clamp of GPT-OSS's swiglu from the config (GptOssSparseMoeBlock);
    # transformers' GptOssConfig does not write it (the real checkpoints' value).
    "gpt_oss": {"swiglu_limit": 7.0},
}


_BUILDERS: Dict[str, Callable] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "deepseek_v2": lambda s, c: _deepseek(s, c, v3=False),
    "deepseek_v3": lambda s, c: _deepseek(s, c, v3=True),
    "glm4_moe": _glm4_moe,
    "qwen3_next": _qwen3_next,
    "qwen3_5_moe": _qwen3_5_moe,
    "gpt_oss": _gpt_oss,
}


def build_tiny_checkpoint(
    family: str,
    out_dir: str,
    shape: TinyShape = TinyShape(),
    dtype: str = "float32",
    seed: int = 0,
) -> str:
    """Write a tiny random checkpoint of ``family`` to ``out_dir`` and return the path.

    Args:
        family: one of ``FAMILIES``.
        out_dir: directory to create (reused as is if it already holds a checkpoint built
            with the same arguments).
        shape: the sizes.
        dtype: ``float32``, ``bfloat16`` or ``float16``: the checkpoint's stored dtype.
        seed: torch seed for the random weights.

    Raises:
        ValueError: unknown family or dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, not {dtype!r}")
    stamp = json.dumps(
        {"family": family, "shape": shape.__dict__, "dtype": dtype, "seed": seed},
        sort_keys=True,
    )
    stamp_path = os.path.join(out_dir, "freetoken_tiny.json")
    if os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    tok = _train_tokenizer(shape.vocab_size)
    vocab = len(tok)
    common = _common(
        shape,
        vocab,
        eos_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    config = _BUILDERS[family](shape, common)
    config.dtype = dtype
    torch.manual_seed(seed)
    if family in HYBRID_FAMILIES:
        # transformers' own init (initializer_range 0.02): with std 0.2 the recurrent layers
        # make a tiny model chaotic, and fp32 op order alone flips its greedy tokens
        config.initializer_range = 0.02
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in (() if family in HYBRID_FAMILIES else model.named_parameters()):
            if p.dim() >= 2:
                p.normal_(0.0, shape.init_std)
            elif "bias" in name and "correction" in name:
                p.normal_(0.0, 0.01)
    if family == "gpt_oss":
        # Gate/up pre-activations with a standard deviation near 8 (near 1.6 at weight std 0.2),
        # so that GPT-OSS's swiglu clamp at 7.0 is reached in the tests.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate_up_proj"):
                    p.mul_(5.0)
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = common["eos_token_id"]
    model.generation_config.pad_token_id = common["pad_token_id"]
    model.save_pretrained(out_dir, safe_serialization=True)
    extra = _EXTRA_CONFIG_KEYS.get(family)
    if extra:
        cfg_path = os.path.join(out_dir, "config.json")
        with open(cfg_path) as f:
            written = json.load(f)
        written.update(extra)
        with open(cfg_path, "w") as f:
            json.dump(written, f, indent=2)
    tok.save_pretrained(out_dir)
    with open(stamp_path, "w") as f:
        f.write(stamp)
    return out_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--head-dim", type=int, default=TinyShape.head_dim)
    p.add_argument("--num-experts", type=int, default=TinyShape.num_experts)
    p.add_argument("--top-k", type=int, default=TinyShape.top_k)
    p.add_argument("--num-layers", type=int, default=TinyShape.num_layers)
    p.add_argument("--hidden-size", type=int, default=TinyShape.hidden_size)
    a = p.parse_args(argv)
    shape = TinyShape(
        head_dim=a.head_dim,
        num_experts=a.num_experts,
        top_k=a.top_k,
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
    )
    print(build_tiny_checkpoint(a.family, a.out, shape=shape, dtype=a.dtype))


if __name__ == "__main__":
    main()
