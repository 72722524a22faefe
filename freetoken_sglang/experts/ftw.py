"""FTW ("FreeToken weights"): the routed experts of a model, written in the host pool's bank layout.

``python -m freetoken_sglang.convert`` writes one directory per model: one raw file per pool
bank (``<bank>.bank``: the bank tensor ``[L*E, *spec.shape]`` byte for byte, row ``l*E + e``
first to last, its data at a 4096-byte aligned offset and the file padded with zeros to a
multiple of 4096) and ``manifest.json``, which holds:

- ``format`` / ``version``: ``"freetoken-ftw"``, ``FORMAT_VERSION``;
- ``model``: the identity of the model the banks belong to (architecture, model_type, the
  MoE layer ids and their count, E, and the sha256 of the source ``config.json``);
- ``expert_format``: the ``ExpertFormat.label`` of the layers' method (``experts/formats.py``,
  e.g. ``"unquantized"`` or ``"fp8_block"``), and ``dtype``, the model's params dtype the
  pool was built with (``--dtype``);
- ``checksum``: the algorithm (``xxh3_64`` when the ``xxhash`` package is importable, else
  ``sha256``) and ``chunk_bytes``: each bank's bytes are checksummed in chunks of that size,
  so the reader verifies them in parallel;
- ``banks``: per bank its name, shape, dtype, row bytes, bytes, file, offset and the chunk
  checksums.

A server started with ``--freetoken-ftw DIR`` skips the routed-expert tensors of the
checkpoint (``patches/model_loader.py``), checks the manifest against the pool the served
model built (``check``), and, before the pool is pinned, reads every bank into the pool's
memory with a thread pool (``load_into_pool``): ``O_DIRECT`` reads into page-aligned staging
buffers where the filesystem accepts them, else buffered ``preadv`` straight into the
bank; every chunk is checksummed by the thread that read it. Anything wrong is one
``FTWError`` naming what and the fix.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import mmap
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from freetoken_sglang.errors import RefusedError

logger = logging.getLogger(__name__)

FORMAT = "freetoken-ftw"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ALIGN = 4096
#: Bytes per checksummed (and per read) chunk of a bank; a multiple of ALIGN.
CHUNK_BYTES = 64 << 20
MIB = 1 << 20


class FTWError(RefusedError):
    """An FTW directory that cannot serve this model (the message names what and the fix)."""


# ---- checksums --------------------------------------------------------------------------
def default_checksum() -> str:
    try:
        import xxhash  # noqa: F401

        return "xxh3_64"
    except ImportError:
        return "sha256"


def _digest(algorithm: str, data) -> str:
    if algorithm == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64_hexdigest(data)
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise FTWError(f"unknown checksum algorithm {algorithm!r}")


# ---- identity ---------------------------------------------------------------------------
def _config_json_path(model_path: str, revision: Optional[str] = None) -> Optional[str]:
    path = os.path.join(model_path, "config.json")
    if os.path.isfile(path):
        return path
    try:  # a hub id already in the local cache
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_path, "config.json", revision=revision)
        return found if isinstance(found, str) else None
    except Exception:
        return None


def config_sha256(model_path: str, revision: Optional[str] = None) -> Optional[str]:
    path = _config_json_path(model_path, revision)
    if path is None:
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def weights_signature(model_path: str) -> Optional[str]:
    """sha256 of the checkpoint's weight files' names and sizes (a fine-tune that keeps the
    config still changes it), or None when the path is not a local directory."""
    if not os.path.isdir(model_path):
        return None
    entries = sorted(
        (f, os.path.getsize(os.path.join(model_path, f)))
        for f in os.listdir(model_path)
        if f.endswith((".safetensors", ".bin", ".pt"))
    )
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def identity(model_config, pool, expert_format: str) -> dict:
    """What a manifest must match: the served model (SGLang's ``ModelConfig``), its pool and
    the layers' expert format."""
    hf = model_config.hf_config
    archs = list(getattr(hf, "architectures", None) or [])
    return {
        "model": {
            "architecture": archs[0] if archs else None,
            "model_type": getattr(hf, "model_type", None),
            "num_moe_layers": pool.num_layers,
            "moe_layer_ids": list(pool.moe_layer_ids),
            "num_experts": pool.num_experts,
            "config_sha256": config_sha256(
                model_config.model_path, getattr(model_config, "revision", None)
            ),
            "weights_signature": weights_signature(model_config.model_path),
        },
        "expert_format": expert_format,
        "dtype": dtype_name(model_config.dtype),
        "banks": {
            name: {
                "shape": [pool.num_rows, *spec.shape],
                "dtype": dtype_name(spec.dtype),
                "row_bytes": spec.row_bytes,
            }
            for name, spec in pool.specs.items()
        },
    }


def _round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def bank_file(name: str) -> str:
    return f"{name}.bank"


def _bank_bytes(bank: torch.Tensor) -> memoryview:
    """A writable byte view of a (contiguous) bank's memory."""
    assert bank.is_contiguous()
    flat = bank.view(torch.uint8).reshape(-1) if bank.numel() else bank.new_empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy())


# ---- write ------------------------------------------------------------------------------
def write(pool, out_dir: str, ident: dict, source: Optional[dict] = None,
          chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Write ``pool``'s banks and the manifest to ``out_dir`` (created; the manifest last, so
    a directory without one is an unfinished conversion). Returns the manifest."""
    assert chunk_bytes % ALIGN == 0
    os.makedirs(out_dir, exist_ok=True)
    stale = os.path.join(out_dir, MANIFEST)
    if os.path.exists(stale):
        os.remove(stale)
    algorithm = default_checksum()
    banks = {}
    for name, bank in pool.banks.items():
        spec = pool.specs[name]
        data = _bank_bytes(bank.contiguous())
        nbytes = len(data)
        sums = []
        fname = bank_file(name)
        with open(os.path.join(out_dir, fname), "wb") as f:
            for start in range(0, nbytes, chunk_bytes):
                piece = data[start:start + chunk_bytes]
                sums.append(_digest(algorithm, piece))
                f.write(piece)
            f.write(b"\0" * (_round_up(nbytes) - nbytes))
            f.flush()
            os.fsync(f.fileno())
        banks[name] = {
            "shape": [pool.num_rows, *spec.shape],
            "dtype": dtype_name(spec.dtype),
            "row_bytes": spec.row_bytes,
            "nbytes": nbytes,
            "file": fname,
            "offset": 0,  # one bank per file: its data starts the file (4096-aligned)
            "checksums": sums,
        }
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model": ident["model"],
        "expert_format": ident["expert_format"],
        "dtype": ident["dtype"],
        "alignment": ALIGN,
        "checksum": {"algorithm": algorithm, "chunk_bytes": chunk_bytes},
        "banks": banks,
        "source": source or {},
    }
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    return manifest


# ---- read and check ---------------------------------------------------------------------
def _fix(ftw_dir: str) -> str:
    return (f"convert the served model again: python -m freetoken_sglang.convert "
            f"--model-path <the --model-path you serve> --out {ftw_dir} (with the same --dtype), "
            "or drop --freetoken-ftw to load the experts from the checkpoint")


def read_manifest(ftw_dir: str) -> dict:
    """The manifest of ``ftw_dir``.

    Raises:
        FTWError: missing, unreadable, not an FTW manifest, or of another format version.
    """
    path = os.path.join(ftw_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FTWError(
            f"--freetoken-ftw {ftw_dir}: no {MANIFEST} there (not an FTW directory, or a "
            f"conversion that did not finish); {_fix(ftw_dir)}"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise FTWError(f"--freetoken-ftw {ftw_dir}: {MANIFEST} is unreadable ({e}); "
                       f"{_fix(ftw_dir)}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise FTWError(
            f"--freetoken-ftw {ftw_dir}: {MANIFEST} is format {manifest.get('format')!r} "
            f"version {manifest.get('version')!r}; this freetoken-sglang reads {FORMAT!r} "
            f"version {FORMAT_VERSION}; {_fix(ftw_dir)}"
        )
    return manifest


def check(ftw_dir: str, manifest: dict, ident: dict) -> None:
    """Refuse a manifest that does not describe the served model's pool, or whose bank files
    are missing or truncated (sizes only; the checksums are verified as the banks load).

    Raises:
        FTWError: naming every difference and the fix.
    """
    problems: List[str] = []
    want_m, got_m = ident["model"], manifest.get("model") or {}
    for key, what in (("architecture", "architecture"), ("model_type", "model_type"),
                      ("num_moe_layers", "MoE layers"), ("moe_layer_ids", "MoE layer ids"),
                      ("num_experts", "experts per layer")):
        if got_m.get(key) != want_m.get(key):
            problems.append(f"{what} {got_m.get(key)!r} in the manifest, but the served model "
                            f"has {want_m.get(key)!r}")
    if (want_m.get("config_sha256") and got_m.get("config_sha256")
            and want_m["config_sha256"] != got_m["config_sha256"]):
        problems.append(
            f"it was converted from another config.json (sha256 "
            f"{got_m['config_sha256'][:12]}... from {(manifest.get('source') or {}).get('model_path')!r}; "
            f"the served model's is {want_m['config_sha256'][:12]}...)"
        )
    if (want_m.get("weights_signature") and got_m.get("weights_signature")
            and want_m["weights_signature"] != got_m["weights_signature"]):
        problems.append(
            "it was converted from other weight files (their names and sizes differ from "
            "the served checkpoint's)"
        )
    if manifest.get("expert_format") != ident["expert_format"]:
        problems.append(f"expert format {manifest.get('expert_format')!r} in the manifest, but "
                        f"the served model's experts are {ident['expert_format']!r}")
    if manifest.get("dtype") != ident["dtype"]:
        problems.append(f"it was converted with --dtype {manifest.get('dtype')}, but the server "
                        f"runs --dtype {ident['dtype']}")
    banks = manifest.get("banks") or {}
    if set(banks) != set(ident["banks"]):
        problems.append(f"banks {sorted(banks)} in the manifest, but the served pool has "
                        f"{sorted(ident['banks'])}")
    for name in sorted(set(banks) & set(ident["banks"])):
        got, want = banks[name], ident["banks"][name]
        for key in ("shape", "dtype", "row_bytes"):
            if got.get(key) != want[key]:
                problems.append(f"bank {name}: {key} {got.get(key)} in the manifest, but the "
                                f"served pool's is {want[key]}")
    algo = (manifest.get("checksum") or {}).get("algorithm")
    chunk = (manifest.get("checksum") or {}).get("chunk_bytes")
    if algo not in ("xxh3_64", "sha256") or not isinstance(chunk, int) or chunk <= 0 \
            or chunk % ALIGN:
        problems.append(f"checksum {manifest.get('checksum')!r} is not one this reader knows")
    if problems:
        raise FTWError(f"--freetoken-ftw {ftw_dir} does not match the served model: "
                       + "; ".join(problems) + f". {_fix(ftw_dir)}")
    for name in sorted(banks):
        b = banks[name]
        path = os.path.join(ftw_dir, str(b.get("file")))
        if b.get("offset", -1) % ALIGN or b.get("offset", -1) < 0:
            problems.append(f"bank {name}: offset {b.get('offset')} is not {ALIGN}-aligned")
            continue
        need = b["offset"] + _round_up(int(b.get("nbytes", -1)))
        if int(b.get("nbytes", -1)) != b["row_bytes"] * b["shape"][0]:
            problems.append(f"bank {name}: {b.get('nbytes')} bytes in the manifest, but "
                            f"{b['shape'][0]} rows of {b['row_bytes']} bytes")
            continue
        if len(b.get("checksums") or []) != -(-b["nbytes"] // chunk):
            problems.append(f"bank {name}: {len(b.get('checksums') or [])} chunk checksums, "
                            f"expected {-(-b['nbytes'] // chunk)}")
            continue
        try:
            size = os.stat(path).st_size
        except OSError as e:
            problems.append(f"bank {name}: file {b.get('file')} is missing ({e.strerror})")
            continue
        if size < need:
            problems.append(f"bank {name}: file {b['file']} is truncated ({size} bytes, the "
                            f"manifest needs {need})")
        elif size > need:
            problems.append(f"bank {name}: file {b['file']} has {size} bytes, more than the "
                            f"{need} the manifest describes")
    if problems:
        raise FTWError(f"--freetoken-ftw {ftw_dir} is corrupt: " + "; ".join(problems)
                       + f". {_fix(ftw_dir)}")


# ---- load -------------------------------------------------------------------------------
def _direct_ok(path: str) -> Tuple[bool, str]:
    """Whether ``path`` can be read with O_DIRECT (an aligned probe read), and why not."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False, "no O_DIRECT on this OS"
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError as e:
        return False, f"open(O_DIRECT) failed: {e.strerror}"
    try:
        buf = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            buf.close()
        return True, ""
    except OSError as e:
        return False, f"an O_DIRECT read failed: {e.strerror}"
    finally:
        os.close(fd)


def _threads(n_items: int, threads: Optional[int]) -> int:
    if threads:
        return max(1, min(threads, n_items))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # reads in flight beyond the cores help fast NVMe; checksums are per thread
    return max(1, min(n_items, max(4, cores or 1)))


def load_into_pool(ftw_dir: str, pool, ident: dict, threads: Optional[int] = None,
                   direct: Optional[bool] = None) -> Dict[str, object]:
    """Check the manifest against ``ident`` and read every bank of ``ftw_dir`` into ``pool``'s
    memory (before it is pinned), verifying every chunk's checksum; a tqdm bar shows the
    bytes. ``direct``: force O_DIRECT on/off (None: where the filesystem allows).

    Returns:
        the load report (seconds, bytes, GB/s, threads, I/O mode).

    Raises:
        FTWError: the manifest or a file is wrong (``check``), a read came back short, or a
            chunk's checksum differs.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    manifest = read_manifest(ftw_dir)
    check(ftw_dir, manifest, ident)
    algorithm = manifest["checksum"]["algorithm"]
    chunk = manifest["checksum"]["chunk_bytes"]
    items = []  # (bank, start, length, checksum)
    for name, b in manifest["banks"].items():
        for i, start in enumerate(range(0, b["nbytes"], chunk)):
            items.append((name, start, min(chunk, b["nbytes"] - start), b["checksums"][i]))
    first = next(iter(manifest["banks"].values()), None)
    if direct is None:
        direct, why = _direct_ok(os.path.join(ftw_dir, first["file"])) if first else (False, "")
    else:
        why = "" if direct else "turned off"
    mode = ("O_DIRECT into page-aligned staging buffers" if direct
            else f"buffered preadv into the pool ({why})")
    n_threads = _threads(len(items), threads)
    fds: Dict[str, int] = {}
    views: Dict[str, memoryview] = {}
    addr: Dict[str, int] = {}
    for name, b in manifest["banks"].items():
        path = os.path.join(ftw_dir, b["file"])
        fds[name] = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        views[name] = _bank_bytes(pool.banks[name])
        addr[name] = pool.banks[name].data_ptr()
        assert len(views[name]) == b["nbytes"]
    local = threading.local()
    bad: List[str] = []
    lock = threading.Lock()
    bar = tqdm(total=sum(b["nbytes"] for b in manifest["banks"].values()), unit="B",
               unit_scale=True, unit_divisor=1024,
               desc=f"FreeToken: loading the expert pool from FTW ({n_threads} threads)")

    def read_item(item):
        name, start, length, want = item
        b = manifest["banks"][name]
        off = b["offset"] + start
        dst = views[name][start:start + length]
        if direct and not ((addr[name] + start) % ALIGN == 0 and length % ALIGN == 0):
            # an unaligned piece (a bank's tail): through a page-aligned buffer
            staging = getattr(local, "buf", None)
            if staging is None:
                staging = local.buf = mmap.mmap(-1, chunk)  # page-aligned
            padded = _round_up(length)
            sm = memoryview(staging)[:padded]
            got = 0
            while got < padded:
                n = os.preadv(fds[name], [sm[got:]], off + got)
                if n <= 0:
                    break
                got += n
            sm.release()
            if got < length:
                raise FTWError(f"--freetoken-ftw {ftw_dir}: bank {name}: file {b['file']} "
                               f"ended at byte {off + got} (truncated while reading); "
                               f"{_fix(ftw_dir)}")
            dst[:] = memoryview(staging)[:length]
        else:  # buffered, or an aligned O_DIRECT chunk straight into the pool (no copy)
            got = 0
            while got < length:
                n = os.preadv(fds[name], [dst[got:]], off + got)
                if n <= 0:
                    raise FTWError(f"--freetoken-ftw {ftw_dir}: bank {name}: file {b['file']}"
                                   f" ended at byte {off + got} (truncated while reading); "
                                   f"{_fix(ftw_dir)}")
                got += n
        digest = _digest(algorithm, dst)
        if digest != want:
            with lock:
                bad.append(f"bank {name} (file {b['file']}) bytes [{start}, {start + length}): "
                           f"{algorithm} {digest} != {want} in the manifest")
        bar.update(length)

    try:
        with concurrent.futures.ThreadPoolExecutor(
                n_threads, thread_name_prefix="freetoken-ftw") as ex:
            for f in [ex.submit(read_item, it) for it in items]:
                f.result()
    except OSError as e:
        raise FTWError(f"--freetoken-ftw {ftw_dir}: reading the banks failed ({e}); "
                       f"{_fix(ftw_dir)}") from e
    finally:
        bar.close()
        for fd in fds.values():
            os.close(fd)
    if bad:
        raise FTWError(f"--freetoken-ftw {ftw_dir}: checksum mismatch, the files are corrupt: "
                       + "; ".join(sorted(bad)) + f". {_fix(ftw_dir)}")
    seconds = time.perf_counter() - t0
    nbytes = sum(b["nbytes"] for b in manifest["banks"].values())
    report = {
        "ftw_dir": ftw_dir,
        "ftw_seconds": seconds,
        "ftw_bytes": nbytes,
        "ftw_gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        "ftw_threads": n_threads,
        "ftw_io": "direct" if direct else "buffered",
        "ftw_checksum": algorithm,
    }
    logger.info(
        "FreeToken: host expert pool loaded from FTW %s: %d banks, %.1f MiB in %.3f s "
        "(%.2f GB/s) with %d threads, %s; %s checksums of %d chunks verified",
        ftw_dir, len(manifest["banks"]), nbytes / MIB, seconds, report["ftw_gbps"],
        n_threads, mode, algorithm, len(items),
    )
    return report


# ---- the runtime's side -----------------------------------------------------------------
def runtime_identity(rt, model_config) -> dict:
    """``identity`` of the pool the runtime ``rt`` built for ``model_config``."""
    method = rt.layers[rt.moe_layer_ids[0]]  # its FreeTokenMoEMethod
    return identity(model_config, rt.pool, method.format.label)


def check_for_runtime(rt, model_config) -> dict:
    """Check ``--freetoken-ftw`` against the built (not yet loaded) model, before SGLang reads
    any weight. Returns the manifest.

    Raises:
        FTWError: as ``check``.
    """
    manifest = read_manifest(rt.config.ftw)
    check(rt.config.ftw, manifest, runtime_identity(rt, model_config))
    return manifest


def load_for_runtime(rt, model_runner) -> Dict[str, object]:
    """Fill ``rt.pool`` from ``--freetoken-ftw`` (``FreeTokenRuntime.finish_load``, before the
    pin). Returns the load report's FTW entries."""
    report = load_into_pool(rt.config.ftw, rt.pool,
                            runtime_identity(rt, model_runner.model_config))
    report["ftw_skipped_checkpoint_tensors"] = getattr(rt, "ftw_skipped_tensors", 0)
    return report
