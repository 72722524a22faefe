"""Host-pool load time and host memory per expert format (BF16, FP8 block, NVFP4), from an FTW directory and from safetensors, against the disk's sequential read bandwidth measured in the same run (issues 13, 15; paper §3.3).

    python benchmarks/bench_load.py --shape qwen3-30b-a3b --layers 12 --dir /tmp/ftload --out OUT.json
    python benchmarks/bench_load.py --shape qwen3-30b-a3b --layers 2 --quant bf16,fp8,nvfp4 \
        --dir /tmp/ftload --out OUT.json

For each format of ``--quant`` (default ``bf16``) it writes a real safetensors checkpoint of a
Qwen3-MoE shape (``servers.SHAPES``, cut to ``--layers`` layers; values are a repeated random
block: only the bytes matter) with the routed experts in that format, in the layout SGLang
0.5.17 loads (as ``freetoken_sglang.tiny_quant`` writes it: ``fp8`` is FP8 block
[128, 128] with fp32 ``weight_scale_inv``, ``nvfp4`` ModelOpt FP4 with e4m3 ``weight_scale``
per 16 and fp32 ``weight_scale_2`` / ``input_scale``; every other module BF16), converts it
with ``python -m freetoken_sglang.convert``, then, each time after dropping the page cache
for those files (``posix_fadvise(DONTNEED)`` per file, and ``/proc/sys/vm/drop_caches`` where
writable):

1. ``dd if=BANK of=/dev/null bs=16M iflag=direct`` over the FTW bank files, one after
   another: the disk's sequential read bandwidth on the same bytes;
2. SGLang's ``ModelRunner`` load (``convert._load``: FreeToken on, no CUDA graphs) from the
   safetensors checkpoint, in a fresh process;
3. the same load with ``--freetoken-ftw``.

Prints and saves the load reports (``FreeTokenRuntime.load_report``: ``pool_bytes`` is the
pool's host memory) with each load process's peak RSS (VmHWM), each load's GB/s of pool bytes, and
both over the dd bandwidth (target: FTW at 0.8 or more); then one table per format against
BF16 measured in the same run (pool bytes, load seconds, experts per GiB). The JSON keeps
the first format's results at the top level (``checkpoint``, ``dd``, ``safetensors``,
``ftw``, ...; BF16's when it is measured) and every format's under ``formats``.
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


QUANTS = ("bf16", "fp8", "nvfp4")
FP8_BLOCK = (128, 128)


def quantized_expert(name: str, shape, quant: str):
    """(name, shape, dtype) of the tensors that hold the routed expert weight ``name`` (BF16
    ``[n, k]``) in ``quant``, as ``tiny_quant.write_fp8_block`` / ``write_nvfp4`` write them."""
    import torch

    n, k = shape
    base = name[: -len("weight")]
    if quant == "fp8":
        return [(name, shape, torch.float8_e4m3fn),
                (base + "weight_scale_inv", (-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1])),
                 torch.float32)]
    return [(name, (n, k // 2), torch.uint8),
            (base + "weight_scale", (n, k // 16), torch.float8_e4m3fn),
            (base + "weight_scale_2", (), torch.float32), (base + "input_scale", (), torch.float32)]


def quantization_config(quant: str, names) -> dict:
    """``tiny_quant``'s ``quantization_config`` of ``quant``: every module but the routed
    experts unquantized (attention, router; embeddings, norms and lm_head are never converted)."""
    from freetoken_sglang.tiny_quant import _not_converted

    if quant == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(FP8_BLOCK),
                "modules_to_not_convert": _not_converted(names)}
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "ignore": _not_converted(names) + ["lm_head"]}


def write_checkpoint(shape: str, layers: int, out: str, quant: str = "bf16",
                     shard_gib: float = 4.0) -> dict:
    """A safetensors checkpoint of ``shape`` with ``layers`` layers in ``out``, its routed
    experts in ``quant`` (random codes, FP8 ones finite; positive scales), the rest bf16."""
    import torch
    from safetensors.torch import save_file

    from freetoken_sglang.tiny_quant import EXPERT_WEIGHT
    from servers import shape_config

    cfg = shape_config(shape, layers)
    if cfg.get("model_type") != "qwen3_moe":
        raise SystemExit(f"--shape {shape}: only Qwen3-MoE shapes are written by this script")
    if quant != "bf16":
        names = (n for n, _, _ in qwen3_moe_tensors(cfg))
        cfg["quantization_config"] = quantization_config(quant, names)
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
        quantized = quant != "bf16" and EXPERT_WEIGHT.search(name)
        parts = (quantized_expert(name, shp, quant) if quantized
                 else [(name, shp, torch.bfloat16)])
        for name, shp, dtype in parts:
            n = 1
            for d in shp:
                n *= d
            nbytes = n * dtype.itemsize
            if is_norm:
                t = torch.ones(shp, dtype=torch.bfloat16)
            elif dtype == torch.float32:  # FP8 / NVFP4 scales
                t = torch.full(shp, 2.0 ** -8)
            else:
                flat = torch.empty((nbytes + 1) // 2, dtype=torch.bfloat16)
                done = 0
                while done < flat.numel():  # the random block, from a moving offset
                    take = min(flat.numel() - done, block.numel() - offset)
                    flat[done:done + take] = block[offset:offset + take]
                    done += take
                    offset = (offset + take + 4099) % block.numel()
                u = flat.view(torch.uint8)[:nbytes]
                if name.endswith("weight_scale"):  # e4m3 scales: positive, finite
                    u = u % 0x7E + 1
                elif dtype == torch.float8_e4m3fn:  # e4m3 codes: no NaN (0x7f, 0xff)
                    u = torch.where((u & 0x7F) == 0x7F, u ^ 1, u)
                t = u.view(dtype).view(shp)
            cur[name] = t
            cur_bytes += nbytes
            if cur_bytes >= shard_gib * GIB:
                flush()
    flush()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    os.sync()
    nbytes = sum(os.path.getsize(os.path.join(out, s)) for s in shards)
    return {"path": out, "quant": quant, "shards": len(shards), "bytes": nbytes,
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
    import resource

    # peak RSS of this process: VmHWM (ru_maxrss starts at the parent's peak: subprocess's
    # vfork + exec carries the parent's high-water mark into the child's)
    hwm = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")]
    rss = {"peak_rss_bytes": hwm[0] * 1024 if hwm else None,
           "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print("LOAD " + json.dumps({"wall_s": time.perf_counter() - t0, **report, **rss}), flush=True)
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


def measure(a, q: str, res: dict, save) -> None:
    """Write, convert, dd and both loads of format ``q`` into ``res`` (``save()`` after each)."""
    sfx = "" if q == "bf16" else "-" + q
    ckpt, ftw_dir = os.path.join(a.dir, "ckpt" + sfx), os.path.join(a.dir, "ftw" + sfx)
    res["checkpoint"] = write_checkpoint(a.shape, a.layers, ckpt, q)
    if os.path.isdir(ftw_dir):
        import shutil

        shutil.rmtree(ftw_dir)
    print(q, "checkpoint", res["checkpoint"], flush=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "freetoken_sglang.convert", "--model-path", ckpt, "--out", ftw_dir]
    if a.device:
        cmd += ["--device", a.device]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:  # measure the safetensors load alone
        res["convert_error"] = r.stderr[-3000:]
        print(f"{q}: convert failed (exit {r.returncode}):\n{r.stderr[-3000:]}", flush=True)
    else:
        res["convert_s"] = time.perf_counter() - t0
    save()
    banks = sorted(glob.glob(os.path.join(ftw_dir, "*.bank")))
    files = banks + sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))
    res["page_cache"] = drop_cache(files)
    if banks:
        res["dd"] = dd_read(banks)
        print(q, "dd", res["dd"], flush=True)
    save()
    for name, src in (("safetensors", ""), ("ftw", ftw_dir))[:2 if banks else 1]:
        drop_cache(files)
        rep = load(ckpt, src, a.device, os.path.join(os.path.dirname(os.path.abspath(a.out)),
                                                     f"bench_load-{name}{sfx}.log"))
        pool = rep["pool_bytes"]
        secs = rep["ftw_seconds"] if name == "ftw" else rep["load_seconds"]
        rep["pool_gb_s"] = pool / secs / 1e9
        if banks:
            rep["over_dd"] = rep["pool_gb_s"] / res["dd"]["gb_s"]
        res[name] = rep
        print(q, name, json.dumps(rep), flush=True)
        save()
    if banks:
        print(f"{q}: pool {res['ftw']['pool_bytes'] / GIB:.2f} GiB; dd {res['dd']['gb_s']:.2f} GB/s; "
              f"safetensors {res['safetensors']['pool_gb_s']:.2f} GB/s "
              f"({res['safetensors']['over_dd']:.2f}x dd); FTW {res['ftw']['pool_gb_s']:.2f} GB/s "
              f"({res['ftw']['over_dd']:.2f}x dd; target 0.8)", flush=True)


def table(res: dict, experts: int) -> str:
    """Each format's pool bytes, load seconds and experts per GiB, and their ratios to BF16's."""
    f, base = res["formats"], res["formats"].get("bf16")

    def x(q, get):  # "value (ratio to BF16)"
        try:
            v = get(f[q])
            return f"{v:.3g}" + (f" ({v / get(base):.2f}x)" if base and q != "bf16" else "")
        except KeyError:
            return "-"

    st, ftw = (lambda r: r["safetensors"]["load_seconds"]), (lambda r: r["ftw"]["ftw_seconds"])
    rows = ["| format | pool GiB | ckpt GB on disk | safetensors load s | FTW pool read s | "
            "FTW load s (rest + pool) | experts per GiB | peak RSS GiB (safetensors / FTW) |",
            "|" + " --- |" * 8]
    for q in f:
        rss = " / ".join(f"{f[q][n]['peak_rss_bytes'] / GIB:.2f}" if n in f[q] else "-"
                         for n in ("safetensors", "ftw"))
        rows.append(f"| {q} | {x(q, lambda r: r['safetensors']['pool_bytes'] / GIB)} | "
                    f"{f[q]['checkpoint']['bytes'] / 1e9:.2f} | {x(q, st)} | {x(q, ftw)} | "
                    f"{x(q, lambda r: r['ftw']['load_seconds'] + r['ftw']['ftw_seconds'])} | "
                    f"{x(q, lambda r: experts / (r['safetensors']['pool_bytes'] / GIB))} | {rss} |")
    if not base:
        rows.append("(bf16 not in --quant: no ratios against BF16 in this run)")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--quant", default="bf16",
                    help=f"expert formats, comma-separated, of {','.join(QUANTS)} (default bf16)")
    ap.add_argument("--dir", help="where the checkpoints and FTWs are written")
    ap.add_argument("--device", default="", help="for the loads (default: cuda if available)")
    ap.add_argument("--out")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ftw", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.ftw, a.device)
    if not a.dir or not a.out:
        ap.error("--dir and --out are required")
    quants = a.quant.split(",")
    if not quants or set(quants) - set(QUANTS):
        ap.error(f"--quant: comma-separated formats of {', '.join(QUANTS)}")
    res = {"shape": a.shape, "layers": a.layers, "quant": quants, "formats": {}}
    first = "bf16" if "bf16" in quants else quants[0]

    def save():  # the first format's results also at the top level, as before --quant
        with open(a.out, "w") as f:
            json.dump({**res, **res["formats"].get(first, {})}, f, indent=1)

    for q in quants:
        measure(a, q, res["formats"].setdefault(q, {}), save)
    from servers import shape_config

    res["table"] = table(res, a.layers * shape_config(a.shape)["num_experts"])
    print(res["table"], flush=True)
    save()
    failed = [q for q, r in res["formats"].items() if "convert_error" in r]
    if failed:
        print(f"FTW conversion failed for {', '.join(failed)} (see convert_error in {a.out})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
