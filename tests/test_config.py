"""The FreeToken flags: argparse surface, Engine keywords, validation and ServerArgs changes."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from freetoken_sglang import config as ft


def parser():
    p = argparse.ArgumentParser()
    ft.add_cli_args(p)
    return p


def test_cli_flags_parse_into_config():
    args = parser().parse_args(["--enable-freetoken", "--freetoken-cache-ratio", "0.25"])
    kwargs = {k: v for k, v in vars(args).items()}
    cfg = ft.pop_config(kwargs)
    assert kwargs == {}
    assert cfg.cache_ratio == 0.25
    assert cfg.cache_gb is None and cfg.cache_slots is None
    assert cfg.kv_reserve_gb == ft.DEFAULT_KV_RESERVE_GB


@pytest.mark.parametrize(
    "argv",
    [
        ["--freetoken-cache-ratio", "abc"],
        ["--freetoken-cache-ratio", "0"],
        ["--freetoken-cache-ratio", "-0.5"],
        ["--freetoken-cache-gb", "x"],
        ["--freetoken-cache-slots", "2.5"],
        ["--freetoken-cache-slots", "0"],
        ["--freetoken-kv-reserve-gb", "-1"],
        ["--freetoken-cache-ratio", "0.2", "--freetoken-cache-slots", "8"],
        ["--freetoken-miss-policy", "lru"],
        ["--freetoken-backend", "tpu"],
        ["--freetoken-bandwidth", "55"],
        ["--freetoken-bandwidth", "55,-1"],
        ["--freetoken-admission", "lfu"],
        ["--freetoken-fill-reused", "yes"],
        ["--freetoken-return-rule", "auto"],
        ["--freetoken-late-fill", "1"],
        ["--freetoken-host-rates", "both"],
        ["--freetoken-bandwidth", "55,90,1,2,0,3"],
        ["--freetoken-cpu-branch", "event"],
        ["--freetoken-cpu-threads", "0"],
        ["--freetoken-prefill-cpu", "1.5"],
        ["--freetoken-prefill-cpu", "half"],
        ["--freetoken-prefill-cpu", "0"],
    ],
)
def test_bad_flag_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--enable-freetoken", *argv])
    assert e.value.code == 2
    assert "freetoken" in capsys.readouterr().err


def test_miss_policy_flags():
    args = parser().parse_args(
        ["--enable-freetoken", "--freetoken-miss-policy", "qstar", "--freetoken-bandwidth",
         "55,90", "--freetoken-cpu-threads", "6", "--freetoken-record-routing", "/tmp/t.npz"]
    )
    cfg = ft.pop_config(dict(vars(args)))
    assert (cfg.miss_policy, cfg.bandwidth, cfg.backend, cfg.cpu_threads) == (
        "qstar", (55.0, 90.0), "gpu", 6
    )
    assert cfg.record_routing == "/tmp/t.npz"
    args = parser().parse_args(["--enable-freetoken", "--freetoken-backend", "cpu"])
    assert ft.pop_config(dict(vars(args))).backend == "cpu"
    default = ft.pop_config({"enable_freetoken": True})
    assert (default.miss_policy, default.backend, default.bandwidth) == ("fill", "gpu", None)
    kw = ft.pop_config(
        {"enable_freetoken": True, "freetoken_miss_policy": "qstar", "freetoken_bandwidth": (20, 40)}
    )
    assert kw.bandwidth == (20.0, 40.0)
    both = ft.pop_config({"enable_freetoken": True, "freetoken_miss_policy": "qstar",
                          "freetoken_admission": "reuse", "freetoken_fill_reused": "on"})
    assert (both.admission, both.fill_reused) == ("reuse", "on")
    assert ft.pop_config({"enable_freetoken": True, "freetoken_miss_policy": "qstar",
                          "freetoken_admission": "useful"}).admission == "useful"
    beside = ft.pop_config({"enable_freetoken": True, "freetoken_miss_policy": "qstar",
                            "freetoken_host_rates": "beside",
                            "freetoken_bandwidth": "40,80,1,2,35,70"})
    assert (beside.host_rates, beside.bandwidth) == ("beside", (40.0, 80.0, 1.0, 2.0, 35.0, 70.0))
    # with cpu: kept for a change to qstar while serving (POST /freetoken/cache)
    assert ft.pop_config({"enable_freetoken": True, "freetoken_miss_policy": "cpu",
                          "freetoken_bandwidth": "10,20"}).bandwidth == (10.0, 20.0)


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"freetoken_backend": "cpu", "freetoken_cache_ratio": 0.5},
         "--freetoken-cache-ratio has no effect with --freetoken-backend cpu"),
        ({"freetoken_backend": "cpu", "freetoken_miss_policy": "qstar"},
         "--freetoken-miss-policy has no effect"),
        ({"freetoken_backend": "cpu", "freetoken_min_free_gb": 4},
         "--freetoken-min-free-gb has no effect with --freetoken-backend cpu"),
        ({"freetoken_bandwidth": "10,20"}, "used only by --freetoken-miss-policy qstar"),
        ({"freetoken_admission": "reuse"}, "--freetoken-admission is used only by"),
        ({"freetoken_fill_reused": "on"}, "--freetoken-fill-reused is used only by"),
        ({"freetoken_return_rule": "on"}, "--freetoken-return-rule is used only by"),
        ({"freetoken_miss_policy": "qstar", "freetoken_return_rule": "on",
          "freetoken_admission": "reuse"}, "sends to the CPU on purpose: give one of them"),
        ({"freetoken_miss_policy": "qstar", "freetoken_return_rule": "on",
          "freetoken_bandwidth": "40,80"}, "needs the branches' fixed costs: give"),
        ({"freetoken_late_fill": "on"}, "--freetoken-late-fill is used only by"),
        ({"freetoken_host_rates": "beside"}, "--freetoken-host-rates is used only by"),
        ({"freetoken_miss_policy": "qstar", "freetoken_host_rates": "beside",
          "freetoken_bandwidth": "40,80,1,2"}, "B_P,B_H,F_P,F_H,B_P',B_H', or no"),
        ({"freetoken_backend": "cpu", "freetoken_host_rates": "beside"},
         "--freetoken-host-rates has no effect with --freetoken-backend cpu"),
        ({"freetoken_miss_policy": "qstar", "freetoken_late_fill": "on",
          "freetoken_return_rule": "on"}, "removes the later fills .* give one of them"),
        ({"freetoken_miss_policy": "qstar", "freetoken_late_fill": "all",
          "freetoken_return_rule": "on"}, "late-fill all removes the later fills"),
        ({"freetoken_backend": "cpu", "freetoken_late_fill": "on"},
         "--freetoken-late-fill has no effect with --freetoken-backend cpu"),
        ({"freetoken_backend": "cpu", "freetoken_return_rule": "on"},
         "--freetoken-return-rule has no effect with --freetoken-backend cpu"),
        ({"freetoken_backend": "cpu", "freetoken_fill_reused": "on"},
         "--freetoken-fill-reused has no effect with --freetoken-backend cpu"),
        ({"freetoken_backend": "cpu", "freetoken_admission": "reuse"},
         "--freetoken-admission has no effect with --freetoken-backend cpu"),
        ({"freetoken_backend": "cpu", "freetoken_fp4_kernels": "dequantized"},
         "--freetoken-fp4-kernels has no effect with --freetoken-backend cpu"),
        ({"freetoken_fp4_kernels": "fast"},
         "invalid choice .fast. \\(choose from direct, dequantized\\)"),
        ({"freetoken_cpu_threads": 4}, "--freetoken-cpu-threads is used only when"),
        ({"freetoken_cpu_isa": "amx"}, "--freetoken-cpu-isa is used only when"),
        ({"freetoken_cpu_branch": "host-node"}, "--freetoken-cpu-branch is used only by"),
        ({"freetoken_backend": "cpu", "freetoken_cpu_branch": "host-node"},
         "--freetoken-cpu-branch has no effect with --freetoken-backend cpu"),
        ({"freetoken_cache_slots": 8, "freetoken_kv_reserve_gb": 4},
         "applies only without a cache-size flag"),
        ({"freetoken_prefill": "lru", "freetoken_stream_min_tokens": 64},
         "--freetoken-stream-min-tokens has no effect with --freetoken-prefill lru"),
        ({"freetoken_prefill": "lru", "freetoken_stream_buffers": 1},
         "--freetoken-stream-buffers has no effect with --freetoken-prefill lru"),
        ({"freetoken_prefill": "lru", "freetoken_prefill_buffers": "reserved"},
         "--freetoken-prefill-buffers has no effect with --freetoken-prefill lru"),
        ({"freetoken_prefill": "lru", "freetoken_prefill_cpu": "auto"},
         "--freetoken-prefill-cpu has no effect with --freetoken-prefill lru"),
        ({"freetoken_backend": "cpu", "freetoken_prefill_cpu": "0.5"},
         "--freetoken-prefill-cpu has no effect with --freetoken-backend cpu"),
        ({"freetoken_prefill_cpu": "0.5", "freetoken_bandwidth": "10,20"},
         "and --freetoken-prefill-cpu auto"),
    ],
)
def test_ineffective_flag_combinations_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ft.pop_config({"enable_freetoken": True, **kw})


def test_prefill_cpu_flag():
    """off by default; auto takes --freetoken-bandwidth and --freetoken-cpu-threads."""
    assert ft.pop_config({"enable_freetoken": True}).prefill_cpu == "off"
    args = parser().parse_args(["--enable-freetoken", "--freetoken-prefill-cpu", "auto",
                                "--freetoken-bandwidth", "50,100", "--freetoken-cpu-threads", "4"])
    cfg = ft.pop_config(dict(vars(args)))
    assert (cfg.prefill_cpu, cfg.bandwidth, cfg.cpu_threads) == ("auto", (50.0, 100.0), 4)
    assert ft.pop_config({"enable_freetoken": True, "freetoken_prefill_cpu": "0.4"}).prefill_cpu == "0.4"


def test_cpu_isa_flag():
    """auto by default; a named path with a CPU part; a path the flag does not know, or one
    this machine lacks, is refused with the flag check, naming the paths it has."""
    from freetoken_sglang.cpu.executor import CpuExpertExecutor

    have = CpuExpertExecutor.available_isas()
    assert ft.pop_config({"enable_freetoken": True}).cpu_isa == "auto"
    args = parser().parse_args(["--enable-freetoken", "--freetoken-prefill-cpu", "auto",
                                "--freetoken-cpu-isa", "portable"])
    assert ft.pop_config(dict(vars(args))).cpu_isa == "portable"
    with pytest.raises(ValueError, match="invalid choice 'sse9'"):
        ft.pop_config({"enable_freetoken": True, "freetoken_miss_policy": "qstar",
                       "freetoken_cpu_isa": "sse9"})
    for isa in ("amx", "avx512_bf16", "avx512", "avx2"):
        if isa in have:
            continue
        with pytest.raises(ValueError) as e:
            ft.pop_config({"enable_freetoken": True, "freetoken_miss_policy": "qstar",
                           "freetoken_cpu_isa": isa})
        msg = str(e.value)
        assert f"--freetoken-cpu-isa {isa}: this CPU, its kernel or this build lacks" in msg
        assert "amx_emulated" not in msg  # not a choice of the flag
        assert f"drop the flag (auto picks {CpuExpertExecutor.best_isa()})" in msg


def test_engine_keywords_are_validated():
    kw = {"enable_freetoken": True, "freetoken_cache_slots": "12", "model_path": "m"}
    cfg = ft.pop_config(kw)
    assert cfg.cache_slots == 12 and kw == {"model_path": "m"}
    with pytest.raises(ValueError, match="freetoken_cache_ratio"):
        ft.pop_config({"enable_freetoken": True, "freetoken_cache_ratio": -1})
    with pytest.raises(ValueError, match="unknown FreeToken option"):
        ft.pop_config({"enable_freetoken": True, "freetoken_cach_ratio": 0.5})
    with pytest.raises(ValueError, match="at most one cache size"):
        ft.pop_config(
            {"enable_freetoken": True, "freetoken_cache_ratio": 0.5, "freetoken_cache_gb": 1}
        )
    with pytest.raises(ValueError, match="without enable_freetoken"):
        ft.pop_config({"freetoken_cache_ratio": 0.5})
    cfg = ft.pop_config({"enable_freetoken": True, "freetoken_stream_buffers": "1",
                         "freetoken_stream_min_tokens": 128})
    assert (cfg.prefill, cfg.stream_buffers, cfg.stream_min_tokens) == ("stream", 1, 128)
    with pytest.raises(ValueError, match="invalid choice '3'"):
        ft.pop_config({"enable_freetoken": True, "freetoken_stream_buffers": 3})
    with pytest.raises(ValueError, match="invalid choice 'off'"):
        ft.pop_config({"enable_freetoken": True, "freetoken_prefill": "off"})
    assert ft.pop_config({"model_path": "m"}) is None


def test_server_args_overrides():
    kw = ft.apply_server_args_overrides({"tp_size": 1, "moe_runner_backend": "auto"})
    assert kw["disable_shared_experts_fusion"] is True
    # Mixed chunked prefill is served (the executor reads each row's routing).
    kw = ft.apply_server_args_overrides({"enable_mixed_chunk": True, "device": "cpu"})
    assert kw["enable_mixed_chunk"] is True and "chunked_prefill_size" not in kw
    for ok in ("breakable", "disabled"):
        ft.apply_server_args_overrides({"cuda_graph_backend_prefill": ok, "device": "cpu"})
    # expert formats FreeToken serves (experts/formats.py); "modelopt" resolves by checkpoint
    for served in ("fp8", "mxfp4", "modelopt_fp4", "modelopt"):
        ft.apply_server_args_overrides({"quantization": served, "device": "cpu"})
    # Prefill through the LRU does not stream: any prefill graph backend is fine.
    lru = ft.pop_config({"enable_freetoken": True, "freetoken_prefill": "lru"})
    ft.apply_server_args_overrides({"cuda_graph_backend_prefill": "full", "device": "cpu"}, lru)
    for bad, needle in [
        ({"tp_size": 2}, "--tp-size must be 1"),
        ({"quantization": "awq"}, "--quantization awq is not served yet"),
        ({"cpu_offload_gb": 4}, "--cpu-offload-gb"),
        ({"moe_runner_backend": "flashinfer_cutlass"}, "--moe-runner-backend"),
        ({"speculative_algorithm": "EAGLE"}, "speculative"),
        ({"cuda_graph_backend_prefill": "full"}, "use breakable .*, --disable-prefill-cuda-graph or"),
        ({"cuda_graph_backend_prefill": "tc_piecewise"}, "--cuda-graph-backend-prefill tc_"),
        ({"enable_torch_compile": True}, "--enable-torch-compile is not supported"),
        ({"enable_pdmux": True}, "--enable-pdmux is not supported"),
        ({"enable_dp_attention": True}, "--enable-dp-attention is not supported"),
        ({"moe_a2a_backend": "deepep"}, "--moe-a2a-backend"),
        ({"disaggregation_mode": "prefill"}, "disaggregation"),
        ({"model_path": "/nonexistent/model"}, "--model-path /nonexistent/model does not exist"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ft.apply_server_args_overrides(dict(bad))


def test_launch_server_help_lists_the_flags():
    from sglang_cpu import cpu_env

    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in (
        "--enable-freetoken",
        "--freetoken-cache-gb",
        "--freetoken-cache-ratio",
        "--freetoken-cache-slots",
        "--freetoken-kv-reserve-gb",
        "--freetoken-miss-policy",
        "--freetoken-bandwidth",
        "--freetoken-backend",
        "--freetoken-cpu-threads",
        "--freetoken-prefill-cpu",
    ):
        assert flag in out.stdout
    # choice flags show their choices, not a placeholder
    for shown in ("--freetoken-fill-reused {off,on,valued}", "--freetoken-stream-buffers {1,2}",
                  "--freetoken-prefill-cpu {off,auto,F}",
                  "--freetoken-cpu-isa {auto,portable,avx2,avx512,avx512_bf16,amx}"):
        assert shown in out.stdout


def test_launch_server_rejects_bad_value_before_loading():
    from sglang_cpu import cpu_env

    out = subprocess.run(
        [
            sys.executable, "-m", "sglang.launch_server", "--model-path", "unused",
            "--enable-freetoken", "--freetoken-cache-ratio", "lots",
        ],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert "--freetoken-cache-ratio: expected a number, got 'lots'" in out.stderr


@pytest.mark.parametrize("quant,needle", [
    ({"quant_method": "modelopt", "quant_algo": "FP8"},
     "ModelOpt FP8 experts are not served yet (ModelOpt NVFP4 is)"),
    ({"quant_method": "awq", "bits": 4}, "quantization 'awq' is not served yet"),
])
def test_unserved_quantizations_name_why(quant, needle):
    from freetoken_sglang.families import quantization_problem

    assert needle in quantization_problem(quant)
    assert quantization_problem({"quant_method": "fp8", "weight_block_size": [128, 128]}) is None
    # the layer checks the rest
    assert quantization_problem({"quant_method": "mxfp4"}) is None
    assert quantization_problem({"quant_method": "modelopt", "quant_algo": "NVFP4"}) is None
    assert quantization_problem({"quant_method": "modelopt_fp4"}) is None
    # quant_algo without quant_method is ModelOpt's, as SGLang reads it
    assert quantization_problem({"quant_algo": "NVFP4", "group_size": 16}) is None
    assert "ModelOpt FP8 experts" in quantization_problem({"quant_algo": "FP8"})


def test_legacy_modelopt_config_is_checked_at_start(tmp_path):
    """ModelOpt's hf_quant_config.json (read by SGLang when config.json has no
    quantization_config) is checked with config.json, before any process starts."""
    import json

    from transformers import Qwen2MoeConfig

    from freetoken_sglang.families import UnsupportedModelError, check_model_path

    Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"]).save_pretrained(tmp_path)
    legacy = tmp_path / "hf_quant_config.json"
    legacy.write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    check_model_path(str(tmp_path))
    legacy.write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(UnsupportedModelError, match="hf_quant_config.json: ModelOpt FP8 experts "
                       "are not served yet"):
        check_model_path(str(tmp_path))


@pytest.mark.parametrize("device,backend", [("cuda", "gpu"), ("cuda", "cpu"), ("cpu", "gpu")])
def test_fp4_formats_are_served_on_every_device_and_backend(device, backend):
    """MXFP4 and NVFP4 go on to SGLang's create_weights under the GPU cache (slots
    dequantized per call) and the CPU backend alike; what they cannot serve is named."""
    from types import SimpleNamespace

    import torch

    from freetoken_sglang.experts.formats import FORMATS
    from freetoken_sglang.families import UnsupportedModelError
    from freetoken_sglang.moe_method import FreeTokenMoEMethod

    class Built(Exception):
        pass

    def original(*a, **kw):
        raise Built

    from freetoken_sglang.config import FreeTokenConfig

    rt = SimpleNamespace(backend=backend, device=torch.device(device), config=FreeTokenConfig())
    base = SimpleNamespace(use_marlin=False, use_flashinfer=False, use_deep_gemm=False,
                           use_triton_kernels=False)
    method = FreeTokenMoEMethod(rt, base, FORMATS["mxfp4"], original)
    layer = SimpleNamespace(_parameters={}, layer_id=0)
    with pytest.raises(Built):
        method.create_weights(layer, 8, 64, 32, torch.bfloat16, with_bias=True)
    assert method.triton_quant.dequantized  # set once the format accepted the method
    assert method.triton_quant.fp4  # decode-sized calls read the codes (the default)
    rt.config = FreeTokenConfig(fp4_kernels="dequantized")
    if (device, backend) == ("cuda", "gpu"):
        with pytest.raises(Built):
            method.create_weights(layer, 8, 64, 32, torch.bfloat16, with_bias=True)
        assert method.triton_quant.dequantized and not method.triton_quant.fp4
    else:  # no GPU cache on CUDA: the flag would do nothing
        with pytest.raises(UnsupportedModelError, match="fp4-kernels dequantized has no effect"):
            method.create_weights(layer, 8, 64, 32, torch.bfloat16, with_bias=True)
    rt.config = FreeTokenConfig()
    base.use_triton_kernels = True
    with pytest.raises(UnsupportedModelError, match="backend for it is triton_kernel, which "
                       "repacks MXFP4 experts at load and is not served; pass "
                       "--moe-runner-backend triton"):
        method.create_weights(layer, 8, 64, 32, torch.bfloat16, with_bias=True)
    # SGLang's own padding of I (here 32 to 64, as with triton_kernels installed) is named
    base = SimpleNamespace(hidden_size=64, intermediate_size_per_partition=64)
    with pytest.raises(UnsupportedModelError, match=r"pads the experts \(H, I\) = \(64, 32\) "
                       r"to \(64, 64\)"):
        FORMATS["mxfp4"].banks(base, layer, 8, 64, 32, torch.bfloat16, True)
    base.intermediate_size_per_partition = 32
    assert FORMATS["mxfp4"].banks(base, layer, 8, 64, 32, torch.bfloat16, True)[
        "w13_weight_scale"].shape == (64, 2)
    # NVFP4 likewise
    nv = SimpleNamespace(quant_config=SimpleNamespace(is_checkpoint_nvfp4_serialized=True,
                                                      group_size=16))
    nv_method = FreeTokenMoEMethod(rt, nv, FORMATS["nvfp4"], original)
    with pytest.raises(Built):
        nv_method.create_weights(layer, 8, 64, 32, torch.bfloat16)
    # what SGLang's NVFP4 method may be asked for that FreeToken does not serve
    nvfp4 = FORMATS["nvfp4"]
    for cfg, needle in [
        (dict(is_checkpoint_nvfp4_serialized=False, group_size=16), "online NVFP4"),
        (dict(is_checkpoint_nvfp4_serialized=True, group_size=32), "group_size 32"),
        (dict(is_checkpoint_nvfp4_serialized=True, group_size=16, is_awq=True), "NVFP4_AWQ"),
    ]:
        assert needle in nvfp4.supports(SimpleNamespace(quant_config=SimpleNamespace(**cfg)))
    gated = SimpleNamespace(moe_runner_config=SimpleNamespace(is_gated=True))
    with pytest.raises(UnsupportedModelError, match="has no expert biases"):
        nvfp4.banks(nv, gated, 8, 64, 32, torch.bfloat16, True)
    with pytest.raises(UnsupportedModelError, match=r"\(H, I\) = \(64, 40\) are not multiples"):
        nvfp4.banks(nv, gated, 8, 64, 40, torch.bfloat16, False)


@pytest.mark.parametrize("backend,policy,limits,fix", [
    ("gpu", "qstar", dict(gemm1_clamp_limit=10.0), "use --freetoken-miss-policy fill"),
    ("gpu", "cpu", dict(swiglu_limit=10.0), "use --freetoken-miss-policy fill"),
    ("cpu", "fill", dict(swiglu_limit=10.0),
     "use --freetoken-backend gpu --freetoken-miss-policy fill"),
    ("gpu", "fill", dict(gemm1_clamp_limit=10.0), None),  # the executor never runs
    ("gpu", "qstar", dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0), None),  # GPT-OSS
])
def test_clamped_silu_without_alpha_is_refused_where_the_cpu_executor_runs(
        backend, policy, limits, fix):
    from types import SimpleNamespace

    from freetoken_sglang.families import UnsupportedModelError
    from freetoken_sglang.runtime import FreeTokenRuntime

    rt = SimpleNamespace(backend=backend, config=SimpleNamespace(miss_policy=policy),
                         family="DeepSeek-V3")
    cfg = SimpleNamespace(**{"gemm1_alpha": None, "gemm1_clamp_limit": None,
                             "swiglu_limit": None, **limits})
    if fix is None:
        FreeTokenRuntime.check_cpu_activation(rt, cfg)
    else:
        with pytest.raises(UnsupportedModelError,
                           match="DeepSeek-V3: the CPU expert executor") as e:
            FreeTokenRuntime.check_cpu_activation(rt, cfg)
        assert str(e.value).endswith(fix)
