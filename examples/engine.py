"""FreeToken from Python: ``sglang.Engine(..., enable_freetoken=True)`` on a given MoE model, or
on the small example model built locally when no ``--model-path`` is given.

    python examples/engine.py                                  # tiny random Qwen3-MoE
    python examples/engine.py --model-path Qwen/Qwen3-30B-A3B

Without an NVIDIA GPU, SGLang 0.5.17 runs on the CPU only with its CPU engine
(``SGLANG_USE_CPU_ENGINE=1``), Triton's interpreter (``TRITON_INTERPRET=1``) and a stand-in
``sgl_kernel`` on the import path (``tests/stubs``; the CUDA wheel does not import without a
driver), all set before sglang is imported, plus the CPU engine's arguments (``device="cpu"``
and the rest of ``CPU_ARGS`` below). This script sets them itself when there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The CPU engine's Engine arguments (the README's "Running on the CPU").
CPU_ARGS = dict(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                cuda_graph_backend_decode="disabled", cuda_graph_backend_prefill="disabled",
                dtype="float32", max_total_tokens=4096)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--cache-ratio", type=float, default=0.25)
    a = ap.parse_args(argv)
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # before sglang is imported
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.path.insert(0, os.path.join(ROOT, "tests", "stubs"))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(ROOT, "tests", "stubs")]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        )  # the Engine's own processes import sgl_kernel too
    model = a.model_path
    if model is None:
        from freetoken_sglang.tiny_models import TinyShape, build_tiny_checkpoint

        model = build_tiny_checkpoint(
            "qwen3_moe", os.path.expanduser("~/.cache/freetoken/tiny-qwen3-moe-engine"),
            TinyShape(num_layers=6, num_experts=16, top_k=4, head_dim=64 if on_gpu else 16),
            dtype="bfloat16" if on_gpu else "float32",
        )
    import sglang as sgl

    engine = sgl.Engine(model_path=model, enable_freetoken=True,
                        freetoken_cache_ratio=a.cache_ratio, **({} if on_gpu else CPU_ARGS))
    try:
        out = engine.generate(
            ["the expert cache holds", "a tool call returns"],
            sampling_params={"temperature": 0, "max_new_tokens": 16},
        )
        for o in out:
            print(repr(o["text"]))
        stats = engine.get_server_info()["internal_states"][0]["freetoken"]
        print("FreeToken:", {k: stats["total"][k] for k in ("reads", "hits", "fills", "cpu")})
    finally:
        engine.shutdown()


if __name__ == "__main__":  # the Engine starts processes: keep the entry point importable
    main()
