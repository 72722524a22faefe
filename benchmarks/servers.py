"""Start, watch and stop ``python -m sglang.launch_server`` processes for the benchmarks, with
a GPU-memory sampler (nvidia-smi) and the full-size model shapes for dummy-weight runs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional

import requests

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(os.path.dirname(HERE), "tests", "stubs")

# Flags of the CPU recipe (README: "Running on the CPU"), for tests and smoke runs without a GPU.
CPU_FLAGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--max-total-tokens", "8192", "--chunked-prefill-size", "512",
    "--skip-server-warmup", "--dtype", "float32", "--sleep-on-idle",
]


def cpu_env(base: Optional[dict] = None) -> dict:
    """Environment of a CPU-run SGLang process: the CPU engine, Triton's interpreter and the
    tests' stand-in ``sgl_kernel`` first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env.update(SGLANG_USE_CPU_ENGINE="1", TRITON_INTERPRET="1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [STUBS] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env

SHAPES = {
    # Qwen3-30B-A3B (config of Qwen/Qwen3-30B-A3B): 48 layers, 128 experts, top-8.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    # Qwen3.6-35B-A3B (config of Qwen/Qwen3.6-35B-A3B, the paper's main model): a hybrid of
    # 30 gated-DeltaNet and 10 full-attention layers, 256 experts, top-8, one shared expert,
    # with its vision tower (dummy weights). The tokenizer is the tiny models' (see
    # write_tokenizer), with a Qwen3-VL processor around it.
    "qwen3.6-35b-a3b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "full_attention_interval": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                            "full_attention"] * 10,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "attn_output_gate": True,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "vocab_size": 248320,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "partial_rotary_factor": 0.25,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                "mrope_section": [11, 11, 10]},
            "tie_word_embeddings": False,
            "eos_token_id": 248044,
            "torch_dtype": "bfloat16",
        },
        "vision_config": {
            "model_type": "qwen3_5_moe",
            "depth": 27,
            "hidden_size": 1152,
            "hidden_act": "gelu_pytorch_tanh",
            "intermediate_size": 4304,
            "num_heads": 16,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 2048,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [],
            "initializer_range": 0.02,
        },
    },
}
# Qwen3-30B-A3B-FP8 (the quantization_config of Qwen/Qwen3-30B-A3B-FP8): every linear
# layer and expert in FP8 e4m3 with 128x128 block scales (FreeToken's pool holds the experts'
# codes and scales).
SHAPES["qwen3-30b-a3b-fp8"] = {
    **SHAPES["qwen3-30b-a3b"],
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}

# Qwen3-30B-A3B with NVFP4 experts (ModelOpt FP4, quant_algo NVFP4; attention and router in
# BF16): stock SGLang runs them on an H200 through its Marlin W4A16 fallback, FreeToken's GPU
# cache by dequantizing the slots each call reads.
SHAPES["qwen3-30b-a3b-nvfp4"] = {
    **SHAPES["qwen3-30b-a3b"],
    "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                            "ignore": ["lm_head", "model.layers.*.self_attn*",
                                       "model.layers.*.mlp.gate"]},
}

# GPT-OSS-120B (config of openai/gpt-oss-120b): 36 layers alternating sliding (128) and full
# attention, 128 experts, top-4, experts in MXFP4 (stock on one H200 needs
# --moe-runner-backend triton_kernel: its default upcasts the experts to BF16, 229 GB; pass
# --moe-runner-backend triton to FreeToken).
SHAPES["gpt-oss-120b"] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "swiglu_limit": 7.0,
    "sliding_window": 128,
    "attention_bias": True,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]},
}


def write_tokenizer(shape: str, out_dir: str) -> str:
    """A tokenizer directory for a dummy-weight shape: the tiny models' BPE and chat template
    (its vocabulary is far smaller than the shape's; the anchor markers are special tokens of
    it), plus a Qwen3-VL processor for a shape with a vision tower (SGLang loads a processor
    for multimodal architectures). Returns the directory."""
    from freetoken_sglang.tiny_models import build_tiny_checkpoint

    cfg = SHAPES[shape]
    family = "qwen3_5_moe" if "text_config" in cfg else "qwen3_moe"
    path = build_tiny_checkpoint(family, out_dir)
    if "vision_config" in cfg:
        from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
        from transformers import Qwen3VLVideoProcessor

        tok = AutoTokenizer.from_pretrained(path)
        v = cfg["vision_config"]
        Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(patch_size=v["patch_size"],
                                                  merge_size=v["spatial_merge_size"],
                                                  temporal_patch_size=v["temporal_patch_size"]),
            tokenizer=tok, video_processor=Qwen3VLVideoProcessor(),
            chat_template=tok.chat_template,
        ).save_pretrained(path)
    return path


def shape_config(name: str, layers: Optional[int] = None) -> dict:
    """The config of a full-size shape, with ``layers`` layers instead of all of them (shapes
    whose layer list is their own, the hybrids' ``layer_types``, refuse a count)."""
    cfg = dict(SHAPES[name])
    if layers:
        if "num_hidden_layers" not in cfg or "layer_types" in cfg:
            raise SystemExit(f"--layers is not supported for the {name} shape")
        cfg["num_hidden_layers"] = layers
    return cfg


def write_shape(name: str, root: str, layers: Optional[int] = None) -> str:
    """A model directory holding only the config of a full-size shape (for dummy weights),
    with ``layers`` layers (``shape_config``)."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(shape_config(name, layers), f, indent=1)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GpuMemorySampler:
    """Samples ``nvidia-smi`` memory.used of GPU 0 every ``interval`` s in a thread;
    ``peak_gib()`` since the last ``reset()`` (0 without nvidia-smi)."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self._peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                     "-i", "0"],
                    capture_output=True, text=True, timeout=5,
                ).stdout.strip()
                self._peak = max(self._peak, int(out.splitlines()[0]))
            except Exception:
                pass
            self._stop.wait(self.interval)

    def reset(self):
        self._peak = 0

    def peak_gib(self) -> float:
        return self._peak / 1024

    def close(self):
        self._stop.set()
        self._t.join(timeout=5)


def _ignore(signum, frame):
    pass


def _raise_exit(signum, frame):
    # One-shot: a second SIGTERM (``timeout`` signals the process, then its group) must not
    # interrupt the cleanup this one starts. A Python no-op, not SIG_IGN, which the
    # processes started during the cleanup would inherit.
    signal.signal(signal.SIGTERM, _ignore)
    raise SystemExit(128 + signum)


def stop_servers_on_sigterm() -> bool:
    """For a benchmark's ``main``: make SIGTERM (what ``timeout`` and job schedulers send)
    raise ``SystemExit(143)`` in the main thread, so that ``with Server(...)`` blocks stop
    their servers on the way out. Without it Python dies at once and the server, in a session
    of its own, keeps running with its GPU memory and pinned host memory.

    Only the benchmark scripts call it, not ``Server``: a test process (pytest) keeps its own
    SIGTERM behaviour. Returns False, installing nothing, off the main thread or where a
    SIGTERM handler other than the default is already set (that handler is left alone)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        return False
    signal.signal(signal.SIGTERM, _raise_exit)
    return True


class Server:
    """A running ``launch_server`` (use as a context manager; stopped on exit, and on SIGTERM
    where the script called ``stop_servers_on_sigterm``).

    Args:
        model_path: the model (or a shape directory with ``--load-format dummy`` in flags).
        flags: extra launch_server flags (after the CPU recipe's, so they override it).
        log_path: where its stdout and stderr go.
        cpu: run with the CPU recipe (CPU_FLAGS, ``cpu_env``).
        timeout: seconds to wait for /health.

    Raises:
        RuntimeError: the process exited or did not become healthy (with the log's tail).
    """

    def __init__(self, model_path: str, flags: List[str], log_path: str, cpu: bool = False,
                 timeout: float = 900.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
                    "--port", str(self.port), *(CPU_FLAGS if cpu else []), *flags]
        self._log = open(log_path, "w")
        t0 = time.time()
        # Its own process group, so that stopping it also stops the scheduler and
        # detokenizer processes it spawned.
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
            env=cpu_env() if cpu else None, start_new_session=True,
        )
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited ({self.proc.returncode}):\n{self.log()[-4000:]}"
                    )
                try:
                    if requests.get(self.url + "/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.time() - t0 > timeout:
                    raise RuntimeError(
                        f"server not healthy after {timeout} s:\n{self.log()[-4000:]}"
                    )
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.time() - t0

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def weights_gb(self) -> Optional[float]:
        """SGLang's own ``Load weight end ... mem usage`` (GB), if logged."""
        m = re.search(r"Load weight end\..*?mem usage=([0-9.]+) GB", self.log())
        return float(m.group(1)) if m else None

    def stop(self) -> None:
        """SIGTERM to the server, SIGKILL after 60 s, then SIGKILL to its process group."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=30)
        finally:
            # The whole group (scheduler, detokenizer), even when the wait was interrupted.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if not self._log.closed:
                self._log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_expecting_failure(model_path: str, flags: List[str], cpu: bool = False,
                          timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run ``launch_server`` until it exits (for servers that must refuse to start)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
           "--port", str(free_port()), *(CPU_FLAGS if cpu else []), *flags]
    return subprocess.run(cmd, env=cpu_env() if cpu else None, capture_output=True,
                          text=True, timeout=timeout)
