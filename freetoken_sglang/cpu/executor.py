"""Python wrapper of the C expert executor: runs missed MoE experts in place on the host pool."""

from __future__ import annotations

import math
from typing import List, Mapping, Optional, Sequence

import torch

try:
    from freetoken_sglang._cpu_executor import ffi as _ffi, lib as _lib
except ImportError as _exc:  # pragma: no cover - exercised through a subprocess in the tests
    raise ImportError(
        "freetoken_sglang._cpu_executor (the compiled C expert executor) is not built. It is "
        "compiled when the package is installed, which needs a C11 compiler (gcc or clang), "
        "the Python development headers (Debian/Ubuntu: `apt-get install gcc python3-dev`) "
        "and cffi>=1.15 (`pip install cffi`). Then, from the repo root, run "
        "`pip install --no-build-isolation -e .` (or `pip install .`), or build the module in "
        "place with `python freetoken_sglang/_cpu_executor_build.py`. "
        f"Import error: {_exc}"
    ) from _exc

__all__ = ["CpuExpertExecutor", "CpuMoeTask", "IsaNotSupportedError", "ISAS"]

#: Kernel paths: "auto" picks the last one the CPU supports, "amx" and "amx_emulated"
#: aside ("amx_emulated", a test path, is the slowest of all). "amx" is "avx512_bf16" plus AMX-BF16 tiles for the experts of a
#: call with at least ``tile_min`` tokens (dense BF16 pools, H and I multiples of 32:
#: prefill-sized CPU work); asked for by name until it is measured in a server.
#: "amx_emulated" runs those tiles' layouts in portable C (tests on CPUs without AMX).
ISAS = ("portable", "amx_emulated", "avx2", "avx512", "avx512_bf16", "amx")

_ISA_CODE = {
    "auto": _lib.FT_ISA_AUTO,
    "portable": _lib.FT_ISA_PORTABLE,
    "avx2": _lib.FT_ISA_AVX2,
    "avx512": _lib.FT_ISA_AVX512,
    "avx512_bf16": _lib.FT_ISA_AVX512_BF16,
    "amx": _lib.FT_ISA_AMX,
    "amx_emulated": _lib.FT_ISA_AMX_EMULATED,
}
_DTYPE_CODE = {
    torch.float32: _lib.FT_DTYPE_F32,
    torch.float16: _lib.FT_DTYPE_F16,
    torch.bfloat16: _lib.FT_DTYPE_BF16,
}
# SGLang's "gelu" (GeluAndMul) defaults to the tanh approximation. "swiglu_oai" (GPT-OSS) is
# selected by gemm1_alpha.
_ACT_CODE = {
    "silu": _lib.FT_ACT_SILU,
    "gelu": _lib.FT_ACT_GELU_TANH,
    "gelu_tanh": _lib.FT_ACT_GELU_TANH,
    "swiglu_oai": _lib.FT_ACT_SWIGLU_OAI,
}
_FMT_CODE = {
    "fp32": _lib.FT_FMT_DENSE,
    "fp16": _lib.FT_FMT_DENSE,
    "bf16": _lib.FT_FMT_DENSE,
    "fp8_block": _lib.FT_FMT_FP8_BLOCK,
    "mxfp4": _lib.FT_FMT_MXFP4,
    "nvfp4": _lib.FT_FMT_NVFP4,
}


class IsaNotSupportedError(RuntimeError):
    """The CPU lacks the kernel path that was asked for."""


def _strerror(code: int) -> str:
    return _ffi.string(_lib.ft_strerror(code)).decode()


def _isa_name(code: int) -> str:
    return _ffi.string(_lib.ft_isa_name(code)).decode()


def _check_isa(isa: str) -> int:
    if isa not in _ISA_CODE:
        raise ValueError(f"isa must be one of {['auto', *ISAS]}, got {isa!r}")
    code = _ISA_CODE[isa]
    if not _lib.ft_isa_supported(code):
        raise IsaNotSupportedError(
            f"this CPU, its kernel or this build does not support the {isa!r} kernel path "
            f"(supported: {CpuExpertExecutor.available_isas()})"
        )
    return code


def _check_bank(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"bank {name!r} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"bank {name!r} must be in host memory, got device {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"bank {name!r} must have {ndim} dims, got shape {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"bank {name!r} must be contiguous")


def _expect(name: str, t: torch.Tensor, dtype, shape) -> None:
    """One-line check of a bank's dtype and shape (``dtype`` a dtype or a tuple of them)."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes or tuple(t.shape) != tuple(shape):
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(
            f"bank {name!r} must be {want} {list(shape)}, got "
            f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"
        )


def _need(banks: Mapping[str, torch.Tensor], name: str, why: str, ndims) -> torch.Tensor:
    """The bank ``name`` (a contiguous CPU tensor with one of ``ndims`` dims)."""
    if name not in banks:
        raise ValueError(f"banks lack {name!r}, needed for {why} (have {sorted(banks)})")
    t = banks[name]
    ndims = ndims if isinstance(ndims, tuple) else (ndims,)
    dim = t.dim() if isinstance(t, torch.Tensor) and t.dim() in ndims else ndims[0]
    _check_bank(name, t, dim)
    return t


def _gated_of(w13: torch.Tensor, w2: torch.Tensor, up_rows: int, inter: int) -> bool:
    if up_rows == 2 * inter:
        return True
    if up_rows == inter:
        return False
    raise ValueError(
        f"w13_weight has {up_rows} rows per expert; expected 2*I={2 * inter} (gated) "
        f"or I={inter} (w2_weight is {list(w2.shape)})"
    )


def _dense_inter(w13: torch.Tensor, w2: torch.Tensor, n: int, hidden: int) -> int:
    """I of an unpacked ``w2_weight [N, H, I]``, its first two dims checked."""
    if w2.shape[0] != n or w2.shape[1] != hidden:
        raise ValueError(
            f"w2_weight must be [N={n}, H={hidden}, I], got {list(w2.shape)} "
            f"(w13_weight is {list(w13.shape)})"
        )
    return w2.shape[2]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pool_layout(banks: Mapping[str, torch.Tensor], block_shape):
    """(format, scales, N, R, H, I, gated) of the banks, every shape and dtype checked;
    scales["banks"] holds the scale banks the format uses."""
    w13, w2 = banks["w13_weight"], banks["w2_weight"]
    n, up_rows, w13_cols = w13.shape
    scales: dict = {"banks": {}}
    if w13.dtype == torch.float8_e4m3fn:
        fmt = "fp8_block"
        why = "fp8 weights (block quant)"
        s13 = _need(banks, "w13_weight_scale_inv", why, 3)
        s2 = _need(banks, "w2_weight_scale_inv", why, 3)
        if block_shape is None:
            raise ValueError(
                "block_shape=[block_n, block_k] is required for fp8 block-quantized banks "
                "(w13_weight_scale_inv / w2_weight_scale_inv)"
            )
        bs = [int(v) for v in block_shape]
        if len(bs) != 2 or min(bs) <= 0:
            raise ValueError(f"block_shape must be [block_n, block_k] > 0, got {list(block_shape)}")
        bn, bk = bs
        hidden = w13_cols
        if w2.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"bank 'w2_weight' must be float8_e4m3fn like w13_weight, got {w2.dtype}"
            )
        inter = _dense_inter(w13, w2, n, hidden)
        gated = _gated_of(w13, w2, up_rows, inter)
        want13 = (n, _cdiv(up_rows, bn), _cdiv(hidden, bk))
        split = (n, 2 * _cdiv(inter, bn), _cdiv(hidden, bk))
        if gated and tuple(s13.shape) == split and split != want13 and s13.dtype == torch.float32:
            scales["split"] = True
        else:
            _expect("w13_weight_scale_inv", s13, torch.float32, want13)
        _expect("w2_weight_scale_inv", s2, torch.float32, (n, _cdiv(hidden, bn), _cdiv(inter, bk)))
        scales["banks"] = {"w13_weight_scale_inv": s13, "w2_weight_scale_inv": s2}
        scales["block_shape"] = (bn, bk)
        return fmt, scales, n, up_rows, hidden, inter, gated
    if w13.dtype == torch.uint8:
        if "w13_weight_scale" not in banks:
            raise ValueError(
                "uint8 (packed fp4) w13_weight needs 'w13_weight_scale' (uint8 e8m0: mxfp4; "
                f"float8_e4m3fn: nvfp4) (have {sorted(banks)})"
            )
        s13 = _need(banks, "w13_weight_scale", "packed fp4 weights", 3)
        if s13.dtype == torch.uint8:
            fmt, gs, sdt = "mxfp4", 32, torch.uint8
        elif s13.dtype == torch.float8_e4m3fn:
            fmt, gs, sdt = "nvfp4", 16, torch.float8_e4m3fn
        else:
            raise ValueError(
                "bank 'w13_weight_scale' must be uint8 (mxfp4) or float8_e4m3fn (nvfp4), "
                f"got {s13.dtype} {list(s13.shape)}"
            )
        s2 = _need(banks, "w2_weight_scale", f"{fmt} weights", 3)
        if w2.dtype != torch.uint8:
            raise ValueError(f"bank 'w2_weight' must be uint8 like w13_weight, got {w2.dtype}")
        hidden = 2 * w13_cols
        if w2.shape[0] != n or w2.shape[1] != hidden:
            raise ValueError(
                f"w2_weight must be [N={n}, H={hidden}, I/2] (w13_weight [N, R, H/2] is "
                f"{list(w13.shape)}), got {list(w2.shape)}"
            )
        inter = 2 * w2.shape[2]
        if hidden % gs or inter % gs:
            raise ValueError(
                f"{fmt} needs H and I multiples of {gs}, got H={hidden}, I={inter}"
            )
        gated = _gated_of(w13, w2, up_rows, inter)
        _expect("w13_weight_scale", s13, sdt, (n, up_rows, hidden // gs))
        _expect("w2_weight_scale", s2, sdt, (n, hidden, inter // gs))
        scales["banks"] = {"w13_weight_scale": s13, "w2_weight_scale": s2}
        if fmt == "nvfp4":
            s13_2 = _need(banks, "w13_weight_scale_2", "nvfp4 weights", (1, 2))
            s2_2 = _need(banks, "w2_weight_scale_2", "nvfp4 weights", (1, 2))
            if gated and tuple(s13_2.shape) == (n, 2):
                scales["scale_2_n"] = 2
            elif tuple(s13_2.shape) in ((n,), (n, 1)):
                scales["scale_2_n"] = 1
            else:
                want = f"[{n}, 2] (or [{n}])" if gated else f"[{n}] (or [{n}, 1])"
                raise ValueError(
                    f"bank 'w13_weight_scale_2' must be float32 {want}, got "
                    f"{str(s13_2.dtype).replace('torch.', '')} {list(s13_2.shape)}"
                )
            _expect("w13_weight_scale_2", s13_2, torch.float32, s13_2.shape)
            if tuple(s2_2.shape) not in ((n,), (n, 1)) or s2_2.dtype != torch.float32:
                raise ValueError(
                    f"bank 'w2_weight_scale_2' must be float32 [{n}] (or [{n}, 1]), got "
                    f"{str(s2_2.dtype).replace('torch.', '')} {list(s2_2.shape)}"
                )
            scales["banks"].update(w13_weight_scale_2=s13_2, w2_weight_scale_2=s2_2)
        return fmt, scales, n, up_rows, hidden, inter, gated
    # dense
    if w13.dtype not in _DTYPE_CODE or w2.dtype != w13.dtype:
        raise ValueError(
            "w13_weight and w2_weight must share one dtype among bf16, fp16, fp32 (or be "
            "float8_e4m3fn / uint8 quantized banks with their scales); got "
            f"{w13.dtype} and {w2.dtype}"
        )
    hidden = w13_cols
    inter = _dense_inter(w13, w2, n, hidden)
    gated = _gated_of(w13, w2, up_rows, inter)
    fmt = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[w13.dtype]
    return fmt, scales, n, up_rows, hidden, inter, gated


class CpuMoeTask:
    """A persistent task descriptor (a C ``ft_moe_task``) whose buffers are raw pointers.

    Made by :meth:`CpuExpertExecutor.make_task`. ``address`` is what a C host callback passes
    to the entry point at :attr:`CpuExpertExecutor.task_entry_address`
    (``void ft_cpu_moe_run(void *task)``); the descriptor lives as long as this object. The
    buffers behind the pointers are the caller's to keep alive and stable.
    """

    def __init__(self, executor: "CpuExpertExecutor", struct):
        self._executor = executor  # keeps the executor (and its banks) alive
        self._struct = struct

    @property
    def address(self) -> int:
        """The descriptor's address (``ft_moe_task *``) as an int."""
        return int(_ffi.cast("uintptr_t", self._struct))

    @property
    def n_items(self) -> int:
        """The item count used when the task has no ``n_items_ptr``."""
        return int(self._struct.n_items)

    @n_items.setter
    def n_items(self, value: int) -> None:
        self._struct.n_items = int(value)

    @property
    def status(self) -> int:
        """The last run's status: 0, or a negative ``FT_ERR_*`` code."""
        return int(self._struct.status)

    @property
    def error_index(self) -> int:
        """The item that made the last run fail, or -1."""
        return int(self._struct.error_index)

    def run(self) -> None:
        """Run the task now on this thread (what the host callback does), then raise as
        :meth:`CpuExpertExecutor.run` does if it failed."""
        self._executor._require_open()
        _lib.ft_cpu_moe_run(self._struct)
        if self.status != _lib.FT_OK:
            raise ValueError(
                f"CPU expert task failed: {_strerror(self.status)} (item {self.error_index})"
            )


class Doorbell:
    """A serving thread for one task, started by the GPU through a doorbell in mapped host
    memory instead of a host-function node (C ``ft_doorbell``, ``cpu_executor.h``).

    The GPU writes the task's inputs and ``*n_rows_ptr``, then a new sequence number into
    ``*ring``; the thread (``threading.Thread`` running ``ft_doorbell_serve``, which holds no
    GIL) runs the task and writes that number into ``*done``. It busy-polls for ``spin_us``
    microseconds after each call, then polls every ``sleep_us``.

    Args:
        task: the :class:`CpuMoeTask` to run (its ``n_rows`` is overwritten per call).
        n_rows_ptr: address of an int32; ring_ptr, done_ptr: addresses of int64s (pinned host
            memory, on separate cache lines).
        spin_us: busy-poll this many microseconds after each call (default 2000).
        sleep_us: then poll every this many microseconds (default 50).

    Stop it (:meth:`stop`) before the executor is closed: the thread calls into it.
    """

    def __init__(self, task: "CpuMoeTask", n_rows_ptr: int, ring_ptr: int, done_ptr: int,
                 spin_us: int = 2000, sleep_us: int = 50):
        import threading

        self._task = task
        db = _ffi.new("ft_doorbell *")
        db.task = task._struct
        db.n_rows_ptr = _ffi.cast("int32_t *", n_rows_ptr)
        db.ring = _ffi.cast("int64_t *", ring_ptr)
        db.done = _ffi.cast("int64_t *", done_ptr)
        db.spin_us, db.sleep_us = int(spin_us), int(sleep_us)
        self._db = db
        self._thread = threading.Thread(target=_lib.ft_doorbell_serve, args=(db,),
                                        name="freetoken-doorbell", daemon=True)
        self._thread.start()

    @property
    def served(self) -> int:
        """Calls served so far."""
        return int(self._db.served)

    @property
    def status(self) -> int:
        """The first failed run's ``FT_ERR_*`` code, or 0."""
        return int(self._db.status)

    @property
    def error_index(self) -> int:
        """The item that made the first failed run fail, or 0."""
        return int(self._db.error_index)

    def stop(self) -> None:
        """Stop the thread and join it (idempotent)."""
        self._db.stop = 1
        if self._thread.is_alive():
            self._thread.join()


class CpuExpertExecutor:
    """Runs routed experts in place on the host expert pool with a pinned C thread pool.

    The weight format is decided from the banks (one format for the whole pool; tensor
    layouts are SGLang's own); quantized weights stay quantized in the banks and are
    dequantized inside the C kernels, with fp32 accumulation:

    * dense (``weight_format`` ``"bf16"`` / ``"fp16"`` / ``"fp32"``): ``w13_weight [N, R, H]``
      (``R = 2I``: gate rows then up rows, or interleaved with ``gate_up_interleaved``;
      ``R = I`` for a non-gated MLP) and ``w2_weight [N, H, I]``, both of one dtype among
      bf16, fp16, fp32.
    * ``"fp8_block"`` (SGLang ``Fp8MoEMethod`` with block quant): ``w13_weight`` /
      ``w2_weight`` ``torch.float8_e4m3fn`` ``[N, R, H]`` / ``[N, H, I]``, fp32
      ``w13_weight_scale_inv [N, ceil(R/bn), ceil(H/bk)]`` (gated and ``I % bn != 0``: also
      ``[N, 2*ceil(I/bn), ceil(H/bk)]``, gate and up blocked separately) and
      ``w2_weight_scale_inv [N, ceil(H/bn), ceil(I/bk)]``, with ``block_shape = [bn, bk]``;
      ``w[r, c] = e4m3(q[r, c]) * scale[r // bn, c // bk]`` (partial last blocks allowed).
    * ``"mxfp4"`` (SGLang ``Mxfp4MoEMethod``, GPT-OSS): uint8 ``w13_weight [N, R, H/2]``,
      ``w2_weight [N, H, I/2]`` (two e2m1 values a byte, low nibble first), uint8 e8m0
      ``w13_weight_scale [N, R, H/32]``, ``w2_weight_scale [N, H, I/32]``; H, I % 32 == 0.
    * ``"nvfp4"`` (SGLang ``ModelOptNvFp4FusedMoEMethod``): packed e2m1 weights as for
      mxfp4, ``torch.float8_e4m3fn`` ``w13_weight_scale [N, R, H/16]``,
      ``w2_weight_scale [N, H, I/16]``, fp32 ``w13_weight_scale_2 [N, 2]`` when gated
      (gate rows, up rows; or ``[N]`` / ``[N, 1]``: one per expert), fp32
      ``w2_weight_scale_2 [N]`` (or ``[N, 1]``); ``w = e2m1 * e4m3(scale) * scale_2``;
      H, I % 16 == 0. (Input scales are not used: activations are not quantized.)

    Optional biases ``w13_weight_bias [N, R]`` and ``w2_weight_bias [N, H]``, fp32 or bf16
    (both of one dtype), in the weights' row order.

    Args:
        banks: the pool's banks (``HostExpertPool.banks``), contiguous CPU tensors with leading
            index ``l*E + e``, as above. The tensors are referenced, not copied, and must not
            be resized while in use.
        activation: ``"silu"``, or ``"gelu"`` / ``"gelu_tanh"`` (tanh approximation); with
            ``gemm1_alpha`` set, ``"silu"`` or ``"swiglu_oai"`` (the GPT-OSS activation).
        num_threads: compute threads including the calling thread; None: one per physical
            core of this process's CPU set.
        isa: kernel path, ``"auto"`` or one of :data:`ISAS`.
        spin_us: microseconds an idle worker spins before it sleeps (None: 200).
        pin_threads: pin each worker thread to its own physical core.
        block_shape: ``[block_n, block_k]`` of fp8 block scales (required for fp8 banks;
            ignored for the other formats).
        gemm1_alpha, gemm1_limit: when ``gemm1_alpha`` is set (GPT-OSS: 1.702, limit 7.0),
            the activation is ``"swiglu_oai"`` (SGLang's Triton runner): with the biases
            added, ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``,
            ``h = g * sigmoid(alpha * g) * (u + 1)``; ``gemm1_limit`` is then required.
        gate_up_interleaved: gated MLPs: rows ``2j`` / ``2j+1`` of ``w13_weight`` (and of its
            bias and scales) are gate ``j`` / up ``j`` (False: gate rows, then up rows).

    Raises:
        ValueError / TypeError: banks of the wrong shape, dtype, device or layout (the message
            names the bank, the expected and the actual shape), a missing scale bank or
            ``block_shape``, or an unknown activation or isa name, or inconsistent activation
            arguments.
        IsaNotSupportedError: ``isa`` names a path this CPU lacks.
        RuntimeError: the C side could not start (memory, threads).
    """

    def __init__(
        self,
        banks: Mapping[str, torch.Tensor],
        activation: str = "silu",
        num_threads: Optional[int] = None,
        isa: str = "auto",
        spin_us: Optional[int] = None,
        pin_threads: bool = True,
        block_shape: Optional[Sequence[int]] = None,
        gemm1_alpha: Optional[float] = None,
        gemm1_limit: Optional[float] = None,
        gate_up_interleaved: bool = False,
    ):
        self._ex = None
        for name in ("w13_weight", "w2_weight"):
            if name not in banks:
                raise ValueError(f"banks lack {name!r} (have {sorted(banks)})")
        w13, w2 = banks["w13_weight"], banks["w2_weight"]
        _check_bank("w13_weight", w13, 3)
        _check_bank("w2_weight", w2, 3)
        fmt, scales, n, up_rows, hidden, inter, gated = _pool_layout(banks, block_shape)
        if n == 0 or hidden == 0 or inter == 0:
            raise ValueError(f"empty banks: w13 {list(w13.shape)}, w2 {list(w2.shape)}")
        biases = {}
        bias_dtype = None
        for name, shape in (("w13_weight_bias", (n, up_rows)), ("w2_weight_bias", (n, hidden))):
            b = banks.get(name)
            if b is None:
                continue
            _check_bank(name, b, 2)
            if b.dtype not in (torch.float32, torch.bfloat16) or tuple(b.shape) != shape:
                raise ValueError(
                    f"bank {name!r} must be float32 or bfloat16 {list(shape)}, got {b.dtype} "
                    f"{list(b.shape)}"
                )
            if bias_dtype is not None and b.dtype != bias_dtype:
                raise ValueError(
                    f"bank {name!r} must have the other bias's dtype {bias_dtype}, got {b.dtype}"
                )
            bias_dtype = b.dtype
            biases[name] = b
        if gemm1_alpha is not None:
            if gemm1_limit is None:
                raise ValueError(
                    "gemm1_alpha is set (swiglu_oai activation): gemm1_limit is required"
                )
            if activation not in ("silu", "swiglu_oai"):
                raise ValueError(
                    f"gemm1_alpha selects the swiglu_oai activation; activation must be 'silu' "
                    f"or 'swiglu_oai', got {activation!r}"
                )
            if not gated:
                raise ValueError("the swiglu_oai activation (gemm1_alpha) needs a gated MLP")
            if not float(gemm1_limit) > 0 or not math.isfinite(float(gemm1_limit)):
                raise ValueError(f"gemm1_limit must be a finite number > 0, got {gemm1_limit}")
            if not math.isfinite(float(gemm1_alpha)):
                raise ValueError(f"gemm1_alpha must be finite, got {gemm1_alpha}")
            activation = "swiglu_oai"
        elif activation == "swiglu_oai":
            raise ValueError("activation 'swiglu_oai' needs gemm1_alpha and gemm1_limit")
        elif gemm1_limit is not None:
            raise ValueError("gemm1_limit is set but gemm1_alpha is not")
        elif activation not in _ACT_CODE:
            raise ValueError(f"activation must be one of {sorted(_ACT_CODE)}, got {activation!r}")
        if gate_up_interleaved and not gated:
            raise ValueError("gate_up_interleaved needs a gated MLP (w13_weight with 2*I rows)")
        if gate_up_interleaved and scales.get("split"):
            raise ValueError(
                "w13_weight_scale_inv with separate gate/up block rows "
                f"{list(banks['w13_weight_scale_inv'].shape)} cannot be gate_up_interleaved"
            )
        isa_code = _check_isa(isa)
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
        if spin_us is not None and spin_us < 0:
            raise ValueError(f"spin_us must be >= 0 or None, got {spin_us}")

        self._banks = {"w13_weight": w13, "w2_weight": w2, **biases, **scales["banks"]}
        self.hidden_size = hidden
        self.intermediate_size = inter
        self.num_experts = n
        self.gated = gated
        self.dtype = w13.dtype
        self.activation = activation
        self.gate_up_interleaved = bool(gate_up_interleaved)
        self.block_shape = scales.get("block_shape")
        self._weight_format = fmt

        def ptr(t, ctype="void *"):
            return _ffi.cast(ctype, t.data_ptr()) if t is not None else _ffi.NULL

        desc = _ffi.new("ft_pool_desc *")
        desc.w13 = ptr(w13)
        desc.w2 = ptr(w2)
        desc.w13_bias = ptr(biases.get("w13_weight_bias"))
        desc.w2_bias = ptr(biases.get("w2_weight_bias"))
        desc.bias_dtype = _DTYPE_CODE[bias_dtype] if bias_dtype is not None else 0
        desc.n_experts = n
        desc.dtype = _DTYPE_CODE.get(w13.dtype, 0)
        desc.hidden = hidden
        desc.inter = inter
        desc.gated = int(gated)
        desc.activation = _ACT_CODE[activation]
        desc.format = _FMT_CODE[fmt]
        desc.gate_up_interleaved = int(bool(gate_up_interleaved))
        if activation == "swiglu_oai":
            desc.alpha = float(gemm1_alpha)
            desc.limit = float(gemm1_limit)
        sb = scales["banks"]
        if fmt == "fp8_block":
            desc.block_n, desc.block_k = self.block_shape
            desc.w13_scale_split = int(bool(scales.get("split")))
            desc.w13_scale = ptr(sb["w13_weight_scale_inv"])
            desc.w2_scale = ptr(sb["w2_weight_scale_inv"])
        elif fmt in ("mxfp4", "nvfp4"):
            desc.w13_scale = ptr(sb["w13_weight_scale"])
            desc.w2_scale = ptr(sb["w2_weight_scale"])
            if fmt == "nvfp4":
                desc.w13_scale_2 = ptr(sb["w13_weight_scale_2"], "float *")
                desc.w2_scale_2 = ptr(sb["w2_weight_scale_2"], "float *")
                desc.w13_scale_2_n = scales["scale_2_n"]
        out = _ffi.new("ft_executor **")
        rc = _lib.ft_executor_create(
            desc,
            num_threads or 0,
            isa_code,
            -1 if spin_us is None else spin_us,
            int(pin_threads),
            out,
        )
        if rc != _lib.FT_OK:
            raise RuntimeError(f"could not start the CPU expert executor: {_strerror(rc)}")
        self._ex = out[0]

    @property
    def weight_format(self) -> str:
        """The pool's weight format: ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8_block"``,
        ``"mxfp4"`` or ``"nvfp4"``."""
        return self._weight_format

    # ---- capabilities ---------------------------------------------------------------------
    @staticmethod
    def available_isas() -> List[str]:
        """The kernel paths this CPU supports, in :data:`ISAS`' order. Asking about "amx"
        requests Linux's AMX permission for the process (``arch_prctl``)."""
        return [name for name in ISAS if _lib.ft_isa_supported(_ISA_CODE[name])]

    @staticmethod
    def best_isa() -> str:
        """The kernel path ``isa="auto"`` picks on this CPU."""
        return _isa_name(_lib.ft_best_isa())

    @staticmethod
    def physical_cores() -> int:
        """Physical cores in this process's CPU set (the default thread count)."""
        return int(_lib.ft_physical_cores())

    # ---- state ----------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._ex is None:
            raise RuntimeError("the CPU expert executor is closed")

    @property
    def isa(self) -> str:
        """The kernel path in use (never ``"auto"``)."""
        self._require_open()
        return _isa_name(_lib.ft_executor_isa(self._ex))

    def set_isa(self, isa: str) -> None:
        """Switch the kernel path for later calls.

        Raises:
            ValueError: unknown name. IsaNotSupportedError: the CPU lacks it.
        """
        self._require_open()
        code = _check_isa(isa)
        rc = _lib.ft_executor_set_isa(self._ex, code)
        if rc != _lib.FT_OK:
            raise IsaNotSupportedError(f"set_isa({isa!r}) failed: {_strerror(rc)}")

    @property
    def tile_min(self) -> int:
        """Experts with at least this many tokens in a call run on AMX tiles (when
        :attr:`tiled`); 8 by default, the first count measured faster than AVX512-BF16."""
        self._require_open()
        return int(_lib.ft_executor_tile_min(self._ex))

    def set_tile_min(self, tokens: int) -> None:
        """Set :attr:`tile_min` (>= 1) for later calls.

        Raises:
            ValueError: ``tokens`` < 1.
        """
        self._require_open()
        if int(tokens) < 1 or _lib.ft_executor_set_tile_min(self._ex, int(tokens)) != _lib.FT_OK:
            raise ValueError(f"tile_min must be at least 1, got {tokens!r}")

    @property
    def tiled(self) -> bool:
        """True when later calls run experts of at least :attr:`tile_min` tokens on tiles:
        an AMX path (``"amx"`` or ``"amx_emulated"``) on a dense BF16 pool with H and I
        multiples of 32."""
        self._require_open()
        return bool(_lib.ft_executor_tiled(self._ex))

    @property
    def schedule(self) -> str:
        """How a call's work is shared between the threads: ``"dynamic"`` (the default:
        chunks from a shared counter, so a thread slowed by another busy thread on its core
        does less) or ``"static"`` (one fixed share per thread; for comparison)."""
        self._require_open()
        return "dynamic" if _lib.ft_executor_schedule(self._ex) == 1 else "static"

    def set_schedule(self, schedule: str) -> None:
        """Choose ``"dynamic"`` or ``"static"`` for later calls.

        Raises:
            ValueError: another name.
        """
        self._require_open()
        if schedule not in ("dynamic", "static"):
            raise ValueError(f"schedule must be 'dynamic' or 'static', not {schedule!r}")
        rc = _lib.ft_executor_set_schedule(self._ex, 1 if schedule == "dynamic" else 0)
        if rc != _lib.FT_OK:
            raise RuntimeError(f"set_schedule({schedule!r}) failed: {_strerror(rc)}")

    def stall_worker(self, tid: int, stall_us: int) -> None:
        """For tests: worker ``tid`` (1 .. ``num_threads - 1``) sleeps ``stall_us``
        microseconds once, right after it next sees a job (a call, a stream read or the
        exit) and before it starts it, as a descheduled worker would
        (``ft_executor_stall_worker``).

        Raises:
            ValueError: ``tid`` is not a worker, or ``stall_us`` < 0.
            RuntimeError: the executor is closed.
        """
        self._require_open()
        if _lib.ft_executor_stall_worker(self._ex, tid, stall_us) != _lib.FT_OK:
            raise ValueError(
                f"stall_worker needs a worker id in 1..{self.num_threads - 1} and "
                f"stall_us >= 0, got {tid}, {stall_us}"
            )

    @property
    def num_threads(self) -> int:
        """Compute threads, the calling thread included."""
        self._require_open()
        return int(_lib.ft_executor_num_threads(self._ex))

    @property
    def num_pinned(self) -> int:
        """Worker threads that pinned themselves to a core (at most ``num_threads - 1``)."""
        self._require_open()
        return int(_lib.ft_executor_num_pinned(self._ex))

    # ---- a call ---------------------------------------------------------------------------
    def run(
        self,
        x: torch.Tensor,
        rows: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """``out[rows[i]] += weights[i] * expert_{experts[i]}(x[rows[i]])`` for every item, in fp32.

        An expert is ``w2 @ (act(gate @ x + b_gate) * (up @ x + b_up)) + b2`` (non-gated:
        ``w2 @ act(w1 @ x + b1) + b2``; ``"swiglu_oai"``: ``act(g, u)`` as in the class
        docstring), its weights read in place from the banks (quantized ones dequantized
        on the fly).

        Args:
            x: ``[T, H]`` bf16, fp16 or fp32 CPU tensor (rows may be strided; unit stride
                along H).
            rows: int32 ``[n]``, token row of each item, in ``[0, T)``.
            experts: int32 ``[n]``, flat expert id ``l*E + e`` in ``[0, N)``; a negative id
                marks padding and is skipped.
            weights: fp32 ``[n]``, the gate weight of each item.
            out: fp32 ``[T, H]`` CPU tensor (unit stride along H), accumulated into.

        Returns:
            ``out``.

        Raises:
            TypeError: an argument is not a tensor.
            ValueError: wrong dtype, device, shape or stride, or a row or expert id out of
                range (the message names the item); nothing is written then.
            RuntimeError: the executor is closed.
        """
        self._require_open()
        H = self.hidden_size
        for name, t in (
            ("x", x),
            ("rows", rows),
            ("experts", experts),
            ("weights", weights),
            ("out", out),
        ):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
        if x.dtype not in _DTYPE_CODE:
            raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"x must be [T, H={H}], got {list(x.shape)}")
        if out.dtype != torch.float32:
            raise ValueError(f"out must be float32, got {out.dtype}")
        if out.dim() != 2 or tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"out must be [T, H] = {list(x.shape)} like x, got {list(out.shape)}")
        for name, t in (("x", x), ("out", out)):
            if t.shape[0] > 1 and (t.stride(1) != 1 or t.stride(0) < H):
                raise ValueError(f"{name} must have unit stride along H and rows >= H apart")
        n = rows.numel()
        for name, t, dt in (
            ("rows", rows, torch.int32),
            ("experts", experts, torch.int32),
            ("weights", weights, torch.float32),
        ):
            if t.dtype != dt:
                raise ValueError(f"{name} must be {dt}, got {t.dtype}")
            if t.dim() != 1 or t.numel() != n:
                raise ValueError(
                    "rows, experts and weights must be 1-D of one length; got rows "
                    f"{list(rows.shape)}, experts {list(experts.shape)}, "
                    f"weights {list(weights.shape)}"
                )
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        T = x.shape[0]
        err = _ffi.new("int32_t *")
        rc = _lib.ft_executor_run(
            self._ex,
            _ffi.cast("void *", x.data_ptr()),
            _DTYPE_CODE[x.dtype],
            x.stride(0) if T > 1 else H,
            T,
            _ffi.cast("int32_t *", rows.data_ptr()),
            _ffi.cast("int32_t *", experts.data_ptr()),
            _ffi.cast("float *", weights.data_ptr()),
            n,
            _ffi.cast("float *", out.data_ptr()),
            out.stride(0) if T > 1 else H,
            0,
            err,
        )
        if rc != _lib.FT_OK:
            i = int(err[0])
            if rc == _lib.FT_ERR_EXPERT:
                raise ValueError(
                    f"experts[{i}] = {int(experts[i])} is outside [0, {self.num_experts}) "
                    f"(the pool's L*E experts)"
                )
            if rc == _lib.FT_ERR_ROW:
                raise ValueError(f"rows[{i}] = {int(rows[i])} is outside [0, T={T})")
            raise ValueError(f"CPU expert run failed: {_strerror(rc)}")
        return out

    def stream_read(self, buf: torch.Tensor) -> int:
        """Read all of ``buf`` (a contiguous CPU tensor) once with every compute thread and
        the executor's kernel path, as a STREAM-like reference for the executor's bandwidth.
        Returns the reduction of the bytes (an int, so the read cannot be skipped)."""
        self._require_open()
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("buf must be a contiguous CPU tensor")
        return int(
            _lib.ft_executor_stream_read(
                self._ex, _ffi.cast("void *", buf.data_ptr()), buf.numel() * buf.element_size()
            )
        )

    # ---- graph-resident use (a C host callback) --------------------------------------------
    @property
    def task_entry_address(self) -> int:
        """Address of ``void ft_cpu_moe_run(void *task)``: a host-function node (e.g.
        ``cuLaunchHostFunc``) calls it with :attr:`CpuMoeTask.address` as its argument."""
        return int(_ffi.cast("uintptr_t", _ffi.addressof(_lib, "ft_cpu_moe_run")))

    def make_task(
        self,
        *,
        x_ptr: int,
        x_dtype: torch.dtype,
        n_rows: int,
        rows_ptr: int,
        experts_ptr: int,
        weights_ptr: int,
        out_ptr: int,
        n_items: int = 0,
        n_items_ptr: int = 0,
        x_row_stride: Optional[int] = None,
        out_row_stride: Optional[int] = None,
        zero_output: bool = False,
    ) -> CpuMoeTask:
        """A persistent task descriptor over raw buffers (e.g. pinned host buffers that a CUDA
        graph fills), for a C host callback or :meth:`CpuMoeTask.run`.

        Args:
            x_ptr: address of ``x [n_rows, x_row_stride]`` in ``x_dtype`` (bf16/fp16/fp32).
            rows_ptr, experts_ptr: addresses of int32 item arrays (as in :meth:`run`;
                negative expert ids are padding).
            weights_ptr: address of the fp32 gate weights.
            out_ptr: address of fp32 ``out [n_rows, out_row_stride]``.
            n_items: item count, read when ``n_items_ptr`` is 0.
            n_items_ptr: address of an int32 item count read at run time (0: none).
            x_row_stride, out_row_stride: elements between rows (default H).
            zero_output: zero ``out[:n_rows, :H]`` before accumulating.

        Returns:
            a :class:`CpuMoeTask`; no buffer is read until it runs.

        Raises:
            ValueError: a null buffer address, an unknown dtype, or a stride below H.
        """
        self._require_open()
        H = self.hidden_size
        if x_dtype not in _DTYPE_CODE:
            raise ValueError(f"x_dtype must be bf16, fp16 or fp32, got {x_dtype}")
        for name, ptr in (
            ("x_ptr", x_ptr),
            ("rows_ptr", rows_ptr),
            ("experts_ptr", experts_ptr),
            ("weights_ptr", weights_ptr),
            ("out_ptr", out_ptr),
        ):
            if not ptr:
                raise ValueError(f"{name} is null")
        xs = H if x_row_stride is None else x_row_stride
        os_ = H if out_row_stride is None else out_row_stride
        if xs < H or os_ < H:
            raise ValueError(f"row strides must be >= H={H}, got x {xs}, out {os_}")
        t = _ffi.new("ft_moe_task *")
        t.executor = self._ex
        t.x = _ffi.cast("void *", x_ptr)
        t.x_row_stride = xs
        t.x_dtype = _DTYPE_CODE[x_dtype]
        t.n_rows = n_rows
        t.rows = _ffi.cast("int32_t *", rows_ptr)
        t.experts = _ffi.cast("int32_t *", experts_ptr)
        t.weights = _ffi.cast("float *", weights_ptr)
        t.n_items = n_items
        t.n_items_ptr = _ffi.cast("int32_t *", n_items_ptr) if n_items_ptr else _ffi.NULL
        t.out = _ffi.cast("float *", out_ptr)
        t.out_row_stride = os_
        t.flags = _lib.FT_RUN_ZERO_OUTPUT if zero_output else 0
        t.error_index = -1
        return CpuMoeTask(self, t)

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop and join the worker threads and free the C state. Idempotent; tasks made by
        this executor must not run afterwards."""
        if self._ex is not None:
            _lib.ft_executor_destroy(self._ex)
            self._ex = None

    def __enter__(self) -> "CpuExpertExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_ex", None) is not None:
            self.close()

    def __repr__(self) -> str:
        state = f"isa={self.isa}, threads={self.num_threads}" if self._ex is not None else "closed"
        return (
            f"CpuExpertExecutor(N={self.num_experts}, H={self.hidden_size}, "
            f"I={self.intermediate_size}, {self.weight_format}, "
            f"{'gated ' if self.gated else ''}{self.activation}, {state})"
        )
