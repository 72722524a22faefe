"""Host-pool load time from an FTW directory and from safetensors, against the disk's sequential read bandwidth measured in the same run (issue 15; paper §3.3).

    python benchmarks/bench_load.py --shape qwen3-30b-a3b --layers 12 --dir /tmp/ftload --out OUT.json

Writes a real safetensors checkpoint of a Qwen3-MoE shape (``servers.SHAPES``, cut to
``--layers`` layers; values are a repeated random block: only the bytes matter), converts it
with ``python -m freetoken_sglang.convert``, then, each time after dropping the page cache
for those files (``posix_fadvise(DONTNEED)`` per file, and ``/proc/sys/vm/drop_caches`` where
writable):

1. ``dd if=BANK of=/dev/null bs=16M iflag=direct`` over the FTW bank files, one after
   another: the disk's sequential read bandwidth on the same bytes;
2. SGLang's ``ModelRunner`` load (``convert._load``: FreeToken on, no CUDA graphs) from the
   safetensors checkpoint, in a fresh process;
3. the same load with ``--freetoken-ftw``.

Prints and saves the load reports (``FreeTokenRuntime.load_report``), each load's GB/s of
pool bytes, and both over the dd bandwidth (target: FTW at 0.8 or more).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

GIB = 1 << 30


def qwen3_moe_tensors(cfg: dict):
    """(name, shape, is_norm) of every tensor of a Qwen3-MoE checkpoint, as on disk."""
    h, v, e, i = cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    yield "model.embed_tokens.weight", (v, h), False
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,), True
        yield p + "post_attention_layernorm.weight", (h,), True
        for n, shape in (("q_proj", (nh * hd, h)), ("k_proj", (nkv * hd, h)),
                         ("v_proj", (nkv * hd, h)), ("o_proj", (h, nh * hd))):
            yield p + f"self_attn.{n}.weight", shape, False
        yield p + "self_attn.q_norm.weight", (hd,), True
        yield p + "self_attn.k_norm.weight", (hd,), True
        yield p + "mlp.gate.weight", (e, h), False
        for x in range(e):
            for n, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                yield p + f"mlp.experts.{x}.{n}.weight", shape, False
    yield "model.norm.weight", (h,), True
    yield "lm_head.weight", (v, h), False


def write_checkpoint(shape: str, layers: int, out: str, shard_gib: float = 4.0) -> dict:
    """A bf16 safetensors checkpoint of ``shape`` with ``layers`` layers in ``out``."""
    import torch
    from safetensors.torch import save_file

    from servers import shape_config

    cfg = shape_config(shape, layers)
    if cfg.get("model_type") != "qwen3_moe":
        raise SystemExit(f"--shape {shape}: only Qwen3-MoE shapes are written by this script")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    g = torch.Generator().manual_seed(0)
    block = (torch.randn(1 << 24, generator=g) * 0.02).to(torch.bfloat16)
    shards, cur, cur_bytes, index = [], {}, 0, {}
    t0 = time.perf_counter()
    offset = 0

    def flush():
        nonlocal cur, cur_bytes
        if cur:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(cur, os.path.join(out, name), metadata={"format": "pt"})
            shards.append(name)
            index.update({k: name for k in cur})
            cur, cur_bytes = {}, 0

    for name, shp, is_norm in qwen3_moe_tensors(cfg):
        n = 1
        for d in shp:
            n *= d
        if is_norm:
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            flat = torch.empty(n, dtype=torch.bfloat16)
            done = 0
            while done < n:  # the random block, from a moving offset
                take = min(n - done, block.numel() - offset)
                flat[done:done + take] = block[offset:offset + take]
                done += take
                offset = (offset + take + 4099) % block.numel()
            t = flat.view(shp)
        cur[name] = t
        cur_bytes += n * 2
        if cur_bytes >= shard_gib * GIB:
            flush()
    flush()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    os.sync()
    nbytes = sum(os.path.getsize(os.path.join(out, s)) for s in shards)
    return {"path": out, "shards": len(shards), "bytes": nbytes,
            "write_s": time.perf_counter() - t0}


def drop_cache(paths) -> str:
    """Evict ``paths``' files from the page cache; says how."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "posix_fadvise(DONTNEED) per file and /proc/sys/vm/drop_caches"
    except OSError:
        return "posix_fadvise(DONTNEED) per file (/proc/sys/vm/drop_caches not writable)"


def dd_read(files) -> dict:
    """Sequential O_DIRECT reads of ``files`` with dd, one after another (buffered where
    the filesystem refuses O_DIRECT)."""
    total, t0, mode = 0, time.perf_counter(), "iflag=direct"
    for f in files:
        cmd = ["dd", f"if={f}", "of=/dev/null", "bs=16M"]
        r = subprocess.run(cmd + ["iflag=direct"], capture_output=True, text=True)
        if r.returncode != 0:
            mode = "buffered (O_DIRECT refused)"
            subprocess.run(cmd, capture_output=True, check=True)
        total += os.path.getsize(f)
    s = time.perf_counter() - t0
    return {"bytes": total, "seconds": s, "gb_s": total / s / 1e9, "mode": mode}


def child(model: str, ftw_dir: str, device: str) -> None:
    from freetoken_sglang import convert

    ns = argparse.Namespace(model_path=model, dtype="auto", trust_remote_code=False,
                            revision=None, device=device or None)
    t0 = time.perf_counter()
    rt, _ = convert._load(ns, **({"freetoken_ftw": ftw_dir} if ftw_dir else {}))
    report = {k: v for k, v in rt.load_report.items() if isinstance(v, (int, float, str, bool))}
    print("LOAD " + json.dumps({"wall_s": time.perf_counter() - t0, **report}), flush=True)
    sys.stdout.flush()
    os._exit(0)


def load(model: str, ftw_dir: str, device: str, log: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, "--ftw", ftw_dir or "",
           "--device", device or ""]
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=1800)
    lines = [x for x in r.stdout.splitlines() if x.startswith("LOAD ")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"load failed (exit {r.returncode}); see {log}")
    return json.loads(lines[-1][5:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dir", help="where the checkpoint and FTW are written")
    ap.add_argument("--device", default="", help="for the loads (default: cuda if available)")
    ap.add_argument("--out")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ftw", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.ftw, a.device)
    if not a.dir or not a.out:
        ap.error("--dir and --out are required")
    ckpt, ftw_dir = os.path.join(a.dir, "ckpt"), os.path.join(a.dir, "ftw")
    res = {"shape": a.shape, "layers": a.layers}

    def save():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    res["checkpoint"] = write_checkpoint(a.shape, a.layers, ckpt)
    if os.path.isdir(ftw_dir):
        import shutil

        shutil.rmtree(ftw_dir)
    print("checkpoint", res["checkpoint"], flush=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "freetoken_sglang.convert", "--model-path", ckpt, "--out", ftw_dir]
    if a.device:
        cmd += ["--device", a.device]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit("convert failed:\n" + r.stderr[-3000:])
    res["convert_s"] = time.perf_counter() - t0
    save()
    banks = sorted(glob.glob(os.path.join(ftw_dir, "*.bank")))
    files = banks + sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))
    res["page_cache"] = drop_cache(files)
    res["dd"] = dd_read(banks)
    print("dd", res["dd"], flush=True)
    save()
    for name, src in (("safetensors", ""), ("ftw", ftw_dir)):
        drop_cache(files)
        rep = load(ckpt, src, a.device, os.path.join(os.path.dirname(os.path.abspath(a.out)),
                                                     f"bench_load-{name}.log"))
        pool = rep["pool_bytes"]
        secs = rep["ftw_seconds"] if name == "ftw" else rep["load_seconds"]
        rep["pool_gb_s"] = pool / secs / 1e9
        rep["over_dd"] = rep["pool_gb_s"] / res["dd"]["gb_s"]
        res[name] = rep
        print(name, json.dumps(rep), flush=True)
        save()
    print(f"pool {res['ftw']['pool_bytes'] / GIB:.2f} GiB; dd {res['dd']['gb_s']:.2f} GB/s; "
          f"safetensors {res['safetensors']['pool_gb_s']:.2f} GB/s "
          f"({res['safetensors']['over_dd']:.2f}x dd); FTW {res['ftw']['pool_gb_s']:.2f} GB/s "
          f"({res['ftw']['over_dd']:.2f}x dd; target 0.8)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
