"""Write a model's routed experts as an FTW directory (``experts/ftw.py``) for a fast start.

    python -m freetoken_sglang.convert --model-path M --out DIR [--dtype D] [--trust-remote-code]
    python -m sglang.launch_server --model-path M --enable-freetoken --freetoken-ftw DIR ...

SGLang itself loads ``M`` with FreeToken on (its own weight loaders fill the host pool, as a
server's start does: with the pure-CPU expert backend, so no expert cache is allocated), and
each bank of the pool is written to its own aligned file with the manifest. ``--dtype`` is
SGLang's (the pool of unquantized experts is in the model's params dtype); serve with the
same one. Without an NVIDIA GPU, run it in the CPU recipe's environment (README, "Running on
the CPU": ``SGLANG_USE_CPU_ENGINE=1`` and a ``sgl_kernel`` SGLang can import).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m freetoken_sglang.convert",
        description="Write the routed experts of a MoE checkpoint in FreeToken's host-pool "
        "bank layout (an FTW directory) for --freetoken-ftw.",
    )
    p.add_argument("--model-path", required=True, help="the checkpoint (as SGLang's)")
    p.add_argument("--out", required=True, help="the FTW directory to write")
    p.add_argument("--dtype", default="auto", help="SGLang's --dtype (default auto)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--revision", default=None)
    p.add_argument("--device", default=None,
                   help="where SGLang builds the model's other weights (default: cuda if "
                   "available, else cpu); the experts always land in host memory")
    return p


def _load(args, **extra):
    """SGLang's ``ModelRunner`` with FreeToken on, weights loaded (``extra``: more
    ``ServerArgs`` fields, e.g. ``freetoken_ftw``); returns the runtime and the runner."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.benchmark.one_batch import load_model
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    from freetoken_sglang.runtime import get_runtime

    kw = dict(device=device, disable_cuda_graph=True, max_total_tokens=256)
    # no attention runs here: a backend every build has
    kw.update(attention_backend="torch_native" if device == "cpu" else "triton",
              sampling_backend="pytorch")
    sa = ServerArgs(
        model_path=args.model_path, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
        revision=args.revision, enable_freetoken=True, freetoken_backend="cpu",
        freetoken_cpu_threads=1, skip_server_warmup=True, **kw, **extra,
    )
    publish(sa, role="convert")
    initialize_moe_config(sa)
    runner, _ = load_model(sa, PortArgs.init_new(sa), 0, 0)
    runner = getattr(runner, "torch_runner", runner)
    return get_runtime(), runner


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from freetoken_sglang.experts import ftw

    t0 = time.perf_counter()
    rt, runner = _load(args)
    load_s = time.perf_counter() - t0
    ident = ftw.runtime_identity(rt, runner.model_config)
    t1 = time.perf_counter()
    manifest = ftw.write(
        rt.pool, args.out, ident,
        source={"model_path": os.path.abspath(args.model_path)
                if os.path.isdir(args.model_path) else args.model_path,
                "revision": args.revision},
    )
    write_s = time.perf_counter() - t1
    nbytes = sum(b["nbytes"] for b in manifest["banks"].values())
    print(
        f"FreeToken: wrote FTW {args.out}: {ident['model']['architecture']}, "
        f"{ident['model']['num_moe_layers']} MoE layers x {ident['model']['num_experts']} "
        f"experts, {ident['expert_format']} experts in {ident['dtype']}, "
        f"{len(manifest['banks'])} banks ({', '.join(manifest['banks'])}), "
        f"{nbytes / (1 << 20):.1f} MiB, {manifest['checksum']['algorithm']} checksums; "
        f"load {load_s:.1f} s, write {write_s:.2f} s. Serve with --enable-freetoken "
        f"--freetoken-ftw {args.out} --dtype {ident['dtype']}",
        flush=True,
    )
    print("FTW " + json.dumps({"out": args.out, "bytes": nbytes, "load_s": load_s,
                               "write_s": write_s}), flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # SGLang's process-global runtime (threads, process groups) stays up
