"""Python wrapper of the C expert executor: runs missed MoE experts in place on the host pool."""

from __future__ import annotations

from typing import List, Mapping, Optional

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

#: Kernel paths, slowest first ("auto" picks the last one the CPU supports).
ISAS = ("portable", "avx2", "avx512", "avx512_bf16")

_ISA_CODE = {
    "auto": _lib.FT_ISA_AUTO,
    "portable": _lib.FT_ISA_PORTABLE,
    "avx2": _lib.FT_ISA_AVX2,
    "avx512": _lib.FT_ISA_AVX512,
    "avx512_bf16": _lib.FT_ISA_AVX512_BF16,
}
_DTYPE_CODE = {
    torch.float32: _lib.FT_DTYPE_F32,
    torch.float16: _lib.FT_DTYPE_F16,
    torch.bfloat16: _lib.FT_DTYPE_BF16,
}
# SGLang's "gelu" (GeluAndMul) defaults to the tanh approximation.
_ACT_CODE = {
    "silu": _lib.FT_ACT_SILU,
    "gelu": _lib.FT_ACT_GELU_TANH,
    "gelu_tanh": _lib.FT_ACT_GELU_TANH,
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
            f"this CPU does not support the {isa!r} kernel path "
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


class CpuExpertExecutor:
    """Runs routed experts in place on the host expert pool with a pinned C thread pool.

    Args:
        banks: the pool's banks (``HostExpertPool.banks``), contiguous CPU tensors with leading
            index ``l*E + e``: ``w13_weight [N, 2I, H]`` (gate rows then up rows; ``[N, I, H]``
            for a non-gated MLP), ``w2_weight [N, H, I]``, both bf16, fp16 or fp32 (the same
            dtype), and optionally fp32 ``w13_weight_bias [N, 2I]`` / ``w2_weight_bias [N, H]``.
            The tensors are referenced, not copied, and must not be resized while in use.
        activation: ``"silu"``, or ``"gelu"`` / ``"gelu_tanh"`` (tanh approximation).
        num_threads: compute threads including the calling thread; None: one per physical
            core of this process's CPU set.
        isa: kernel path, ``"auto"`` or one of :data:`ISAS`.
        spin_us: microseconds an idle worker spins before it sleeps (None: 200).
        pin_threads: pin each worker thread to its own physical core.

    Raises:
        ValueError / TypeError: banks of the wrong shape, dtype, device or layout, or an
            unknown activation or isa name.
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
    ):
        self._ex = None
        for name in ("w13_weight", "w2_weight"):
            if name not in banks:
                raise ValueError(f"banks lack {name!r} (have {sorted(banks)})")
        w13, w2 = banks["w13_weight"], banks["w2_weight"]
        _check_bank("w13_weight", w13, 3)
        _check_bank("w2_weight", w2, 3)
        if w13.dtype not in _DTYPE_CODE or w2.dtype != w13.dtype:
            raise ValueError(
                "w13_weight and w2_weight must share one dtype among bf16, fp16, fp32; got "
                f"{w13.dtype} and {w2.dtype}"
            )
        n, up_rows, hidden = w13.shape
        if w2.shape[0] != n or w2.shape[1] != hidden:
            raise ValueError(
                f"w2_weight must be [N={n}, H={hidden}, I], got {list(w2.shape)} "
                f"(w13_weight is {list(w13.shape)})"
            )
        inter = w2.shape[2]
        if up_rows == 2 * inter:
            gated = True
        elif up_rows == inter:
            gated = False
        else:
            raise ValueError(
                f"w13_weight has {up_rows} rows per expert; expected 2*I={2 * inter} (gated) "
                f"or I={inter} (w2_weight is {list(w2.shape)})"
            )
        if n == 0 or hidden == 0 or inter == 0:
            raise ValueError(f"empty banks: w13 {list(w13.shape)}, w2 {list(w2.shape)}")
        biases = {}
        for name, shape in (("w13_weight_bias", (n, up_rows)), ("w2_weight_bias", (n, hidden))):
            b = banks.get(name)
            if b is None:
                continue
            _check_bank(name, b, 2)
            if b.dtype != torch.float32 or tuple(b.shape) != shape:
                raise ValueError(
                    f"bank {name!r} must be float32 {list(shape)}, got {b.dtype} {list(b.shape)}"
                )
            biases[name] = b
        if activation not in _ACT_CODE:
            raise ValueError(f"activation must be one of {sorted(_ACT_CODE)}, got {activation!r}")
        isa_code = _check_isa(isa)
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
        if spin_us is not None and spin_us < 0:
            raise ValueError(f"spin_us must be >= 0 or None, got {spin_us}")

        self._banks = {"w13_weight": w13, "w2_weight": w2, **biases}
        self.hidden_size = hidden
        self.intermediate_size = inter
        self.num_experts = n
        self.gated = gated
        self.dtype = w13.dtype
        self.activation = activation

        desc = _ffi.new("ft_pool_desc *")
        desc.w13 = _ffi.cast("void *", w13.data_ptr())
        desc.w2 = _ffi.cast("void *", w2.data_ptr())
        desc.w13_bias = (
            _ffi.cast("float *", biases["w13_weight_bias"].data_ptr())
            if "w13_weight_bias" in biases
            else _ffi.NULL
        )
        desc.w2_bias = (
            _ffi.cast("float *", biases["w2_weight_bias"].data_ptr())
            if "w2_weight_bias" in biases
            else _ffi.NULL
        )
        desc.n_experts = n
        desc.dtype = _DTYPE_CODE[w13.dtype]
        desc.hidden = hidden
        desc.inter = inter
        desc.gated = int(gated)
        desc.activation = _ACT_CODE[activation]
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

    # ---- capabilities ---------------------------------------------------------------------
    @staticmethod
    def available_isas() -> List[str]:
        """The kernel paths this CPU supports, slowest first."""
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
        ``w2 @ act(w1 @ x + b1) + b2``), its weights read in place from the banks.

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
            f"I={self.intermediate_size}, {str(self.dtype).replace('torch.', '')}, "
            f"{'gated ' if self.gated else ''}{self.activation}, {state})"
        )
