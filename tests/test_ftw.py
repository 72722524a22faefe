"""FTW fast start (``experts/ftw.py``, ``python -m freetoken_sglang.convert``, ``--freetoken-ftw``):
a tiny checkpoint of two families (DeepSeek-V2's first layer is dense) is converted, served
from the FTW directory and from its safetensors, with the same greedy tokens; the FTW server
read no routed-expert tensor of the checkpoint and says where its pool came from. A truncated
bank, an altered byte and another model's directory are refused at start with what is wrong;
the manifest round-trips and its banks are aligned."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import requests
import torch

from sglang_cpu import cpu_env, run_launch_server_expecting_failure, start_server
from test_e2e_families import FAMILY_SHAPES, PROMPTS, greedy
from test_startup import assert_clean_refusal

from freetoken_sglang.experts import ftw
from freetoken_sglang.experts.pool import BankSpec, HostExpertPool

FAMILIES = ("qwen3_moe", "deepseek_v2")
FT = ["--enable-freetoken", "--freetoken-cache-ratio", "0.25"]
# A short prompt and one that streams its layers at prefill; few tokens (the Triton
# interpreter makes every decode step slow on the CPU).
REQUESTS = [PROMPTS[0], PROMPTS[2]]
NEW_TOKENS = 12


def convert(model_path: str, out: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "freetoken_sglang.convert", "--model-path", model_path,
         "--out", out, "--dtype", "float32"],
        env=cpu_env(), capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "wrote FTW" in r.stdout
    return out


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    """family -> (checkpoint, FTW dir), converted once per module."""
    root = tmp_path_factory.mktemp("ftw")
    cache = {}

    def get(family):
        if family not in cache:
            path = tiny_checkpoint(family, **FAMILY_SHAPES[family])
            cache[family] = (path, convert(path, str(root / family)))
        return cache[family]

    return get


def _serve(path, args, log_path):
    server = start_server(path, args, log_path=log_path)
    try:
        out = [greedy(server.url, p, NEW_TOKENS) for p in REQUESTS]
        stats = requests.get(server.url + "/freetoken/stats", timeout=60).json()
    finally:
        server.stop()
    return out, stats, server.log()


@pytest.mark.parametrize("family", FAMILIES)
def test_served_from_ftw_matches_safetensors(converted, family, tmp_path):
    path, ftw_dir = converted(family)
    want, _, _ = _serve(path, FT, str(tmp_path / "safetensors.log"))
    got, stats, log = _serve(path, FT + ["--freetoken-ftw", ftw_dir], str(tmp_path / "ftw.log"))
    assert got == want, f"{family}: FTW {got} != safetensors {want}"
    assert f"host expert pool loaded from FTW {ftw_dir}" in log
    # every routed expert tensor of the checkpoint (gate, up, down per expert) was skipped
    experts = stats["pool"]["experts"]
    assert f"skipped {3 * experts} routed-expert tensors" in log
    load = stats["load"]
    assert load["ftw_skipped_checkpoint_tensors"] == 3 * experts
    assert load["ftw_bytes"] == stats["pool"]["bytes"]
    assert load["ftw_io"] in ("direct", "buffered") and load["ftw_checksum"] == "xxh3_64"


def _copy(ftw_dir, dst):
    shutil.copytree(ftw_dir, dst)
    return str(dst)


def _refused(path, ftw_dir):
    r = run_launch_server_expecting_failure(path, FT + ["--freetoken-ftw", ftw_dir])
    assert_clean_refusal(r)
    return r.stdout + r.stderr


def test_truncated_bank_is_refused(converted, tmp_path):
    path, ftw_dir = converted("qwen3_moe")
    bad = _copy(ftw_dir, tmp_path / "truncated")
    f = os.path.join(bad, "w2_weight.bank")
    size = os.path.getsize(f)
    os.truncate(f, size - 8192)
    text = _refused(path, bad)
    assert (f"--freetoken-ftw {bad} is corrupt: bank w2_weight: file w2_weight.bank is "
            f"truncated ({size - 8192} bytes, the manifest needs {size})") in text
    assert "python -m freetoken_sglang.convert" in text


def test_altered_byte_is_refused(converted, tmp_path):
    path, ftw_dir = converted("qwen3_moe")
    bad = _copy(ftw_dir, tmp_path / "altered")
    with open(os.path.join(bad, "w13_weight.bank"), "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0x40]))
    text = _refused(path, bad)
    assert f"--freetoken-ftw {bad}: checksum mismatch, the files are corrupt: bank w13_weight" in text
    assert "python -m freetoken_sglang.convert" in text


def test_another_models_ftw_is_refused(converted, tiny_checkpoint, tmp_path):
    _, qwen_ftw = converted("qwen3_moe")
    deepseek = tiny_checkpoint("deepseek_v2", **FAMILY_SHAPES["deepseek_v2"])
    text = _refused(deepseek, qwen_ftw)
    assert f"--freetoken-ftw {qwen_ftw} does not match the served model" in text
    assert ("architecture 'Qwen3MoeForCausalLM' in the manifest, but the served model has "
            "'DeepseekV2ForCausalLM'") in text
    assert "converted from another config.json" in text


# ---- unit -------------------------------------------------------------------------------
def _pool(seed=0, dtype=torch.float32):
    specs = {"w13_weight": BankSpec((6, 5), dtype), "w2_weight": BankSpec((5, 3), dtype),
             "w13_weight_bias": BankSpec((6,), torch.float32)}
    pool = HostExpertPool([1, 2, 4], 4, specs)
    g = torch.Generator().manual_seed(seed)
    for b in pool.banks.values():
        b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return pool


class _Cfg:
    def __init__(self, model_path, dtype=torch.float32):
        self.model_path = model_path
        self.dtype = dtype
        self.revision = None
        self.hf_config = type("C", (), {"architectures": ["TinyMoe"], "model_type": "tiny"})()


def _ident(tmp_path, pool, dtype=torch.float32):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"a": 1}')
    return ftw.identity(_Cfg(str(model), dtype), pool, "unquantized")


@pytest.mark.parametrize("direct", [True, False])
def test_manifest_round_trip_and_alignment(tmp_path, direct):
    probe = tmp_path / "probe"
    probe.write_bytes(b"\0" * ftw.ALIGN)
    if direct and not ftw._direct_ok(str(probe))[0]:
        pytest.skip(f"O_DIRECT is not available on {tmp_path}'s filesystem (e.g. tmpfs)")
    pool = _pool()
    ident = _ident(tmp_path, pool)
    out = str(tmp_path / "ftw")
    # small chunks: several per bank, read and verified by several threads
    written = ftw.write(pool, out, ident, chunk_bytes=4096)
    manifest = ftw.read_manifest(out)
    assert manifest == json.loads(json.dumps(written))
    assert manifest["model"]["moe_layer_ids"] == [1, 2, 4]
    assert manifest["checksum"] == {"algorithm": "xxh3_64", "chunk_bytes": 4096}
    for name, b in manifest["banks"].items():
        assert b["offset"] % ftw.ALIGN == 0
        assert os.path.getsize(os.path.join(out, b["file"])) % ftw.ALIGN == 0
        assert b["shape"] == [12, *pool.specs[name].shape]
        assert b["nbytes"] == 12 * pool.specs[name].row_bytes
        assert len(b["checksums"]) == -(-b["nbytes"] // 4096)
    fresh = _pool(seed=1)
    report = ftw.load_into_pool(out, fresh, ident, threads=3, direct=direct)
    for name in pool.banks:
        assert torch.equal(fresh.banks[name], pool.banks[name]), name
    assert report["ftw_io"] == ("direct" if direct else "buffered")
    assert report["ftw_bytes"] == pool.nbytes


def test_check_names_what_differs(tmp_path):
    pool = _pool()
    ident = _ident(tmp_path, pool)
    out = str(tmp_path / "ftw")
    ftw.write(pool, out, ident)
    manifest = ftw.read_manifest(out)
    with pytest.raises(ftw.FTWError, match="converted with --dtype float32, but the server "
                                           "runs --dtype bfloat16"):
        ftw.check(out, manifest, _ident(tmp_path, _pool(dtype=torch.bfloat16), torch.bfloat16))
    other = HostExpertPool([1, 2, 4], 4, {"w13_weight": BankSpec((8, 5), torch.float32),
                                          "w2_weight": BankSpec((5, 4), torch.float32),
                                          "w13_weight_bias": BankSpec((8,), torch.float32)})
    with pytest.raises(ftw.FTWError, match=r"bank w13_weight: shape \[12, 6, 5\] in the "
                                           r"manifest, but the served pool's is \[12, 8, 5\]"):
        ftw.check(out, manifest, _ident(tmp_path, other))
    os.remove(os.path.join(out, ftw.MANIFEST))
    with pytest.raises(ftw.FTWError, match="no manifest.json there"):
        ftw.read_manifest(out)
    with open(os.path.join(out, ftw.MANIFEST), "w") as f:
        f.write("{not json")
    with pytest.raises(ftw.FTWError, match="manifest.json is unreadable"):
        ftw.read_manifest(out)
