"""Start an SGLang server with FreeToken: a given MoE model, or a small example model built
locally when no ``--model-path`` is given.

    python examples/serve.py                          # tiny random Qwen3-MoE, 25% cache
    python examples/serve.py --model-path Qwen/Qwen3-30B-A3B --freetoken-cache-gb 8

Every other argument goes to ``sglang serve`` unchanged. Without an NVIDIA
GPU the server runs on the CPU (the README's CPU recipe: CPU engine, torch-native attention,
no CUDA graphs, the tests' stand-in ``sgl_kernel``), which is how the example runs on a
machine with no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--example-dir", default=os.path.expanduser("~/.cache/freetoken/tiny-qwen3-moe"))
    ap.add_argument("--port", default="30000")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.help:
        print(__doc__)
        return
    import torch

    on_gpu = torch.cuda.is_available()
    model = args.model_path
    if model is None:
        from freetoken_sglang.tiny_models import TinyShape, build_tiny_checkpoint

        model = build_tiny_checkpoint(
            "qwen3_moe",
            args.example_dir,
            TinyShape(num_layers=6, num_experts=16, top_k=4, head_dim=64 if on_gpu else 16),
            dtype="bfloat16" if on_gpu else "float32",
        )
        print(f"example model: {model} (tiny random Qwen3-MoE, 6 layers x 16 experts)")
    # SGLang's recommended entry point (``python -m sglang.launch_server`` warns that it is
    # the old one); both take the same flags.
    cmd = [sys.executable, "-c", "from sglang.cli.main import main; main()", "serve",
           "--model-path", model, "--port", args.port, "--enable-freetoken"]
    if not any(a.startswith("--freetoken-cache-") for a in rest):
        cmd += ["--freetoken-cache-ratio", "0.25"]
    env = dict(os.environ)
    if not on_gpu:
        cmd += ["--device", "cpu", "--attention-backend", "torch_native",
                "--sampling-backend", "pytorch", "--cuda-graph-backend-decode", "disabled",
                "--cuda-graph-backend-prefill", "disabled",
                "--max-total-tokens", "8192", "--max-running-requests", "8",
                "--chunked-prefill-size", "512", "--dtype", "float32", "--sleep-on-idle"]
        env.update(SGLANG_USE_CPU_ENGINE="1", TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(ROOT, "tests", "stubs")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        print("no NVIDIA GPU: serving on the CPU")
    cmd += rest
    print(" ".join(cmd), flush=True)
    print(
        f"when it is up (Ctrl+C stops it), try (any model name works):\n"
        f"  curl http://127.0.0.1:{args.port}/v1/chat/completions -H 'Content-Type: application/json' "
        "-d '{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], \"max_tokens\": 16}'\n"
        f"  curl http://127.0.0.1:{args.port}/freetoken/stats",
        flush=True,
    )
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
