"""Test set-up: SGLang runs on the CPU (the README's CPU recipe) with the stand-in sgl_kernel,
and tiny random checkpoints are built once per session."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
import torch  # noqa: E402  (imports no Triton kernel)

# Must precede any sglang / triton import in this process. Without a GPU, SGLang runs on the
# CPU and Triton kernels run in Triton's interpreter.
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The stand-in sgl_kernel only where the real one cannot load (no GPU).
for p in ([HERE] if ON_GPU else [os.path.join(HERE, "stubs"), HERE]):
    if p not in sys.path:
        sys.path.insert(0, p)

# Tests that run Triton kernels on CPU tensors need the interpreter.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs Triton kernels on CPU tensors (TRITON_INTERPRET=1); tests/test_gpu.py "
    "covers them on CUDA",
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_dir):
    """build(family, **shape) -> path of a tiny random checkpoint (cached per session)."""
    from freetoken_sglang.tiny_models import TinyShape, build_tiny_checkpoint

    def build(family: str, dtype: str = "float32", **shape):
        name = family + "".join(f"-{k}{v}" for k, v in sorted(shape.items())) + f"-{dtype}"
        return build_tiny_checkpoint(
            family, str(tiny_dir / name), shape=TinyShape(**shape), dtype=dtype
        )

    return build


@pytest.fixture(scope="module")
def published_server_args(tiny_checkpoint):
    """SGLang's kernels read config bags that a server publishes at start, and its fused MoE
    asks for the tensor-parallel group (a one-process group here, as a server makes; gloo
    without a GPU)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.network import get_free_port

    publish(ServerArgs(model_path=tiny_checkpoint("qwen3_moe")), role="test")
    made_dist = not torch.distributed.is_initialized()
    if made_dist:
        ps.init_distributed_environment(
            world_size=1, rank=0, local_rank=0,
            backend="nccl" if torch.cuda.is_available() else "gloo",
            distributed_init_method=f"tcp://127.0.0.1:{get_free_port()}",
        )
    made_groups = not ps.model_parallel_is_initialized()
    if made_groups:
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    if made_groups:
        ps.destroy_model_parallel()
    if made_dist:
        ps.destroy_distributed_environment()
