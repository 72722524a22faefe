"""The CPU branch of a MoE layer call: its CPU experts on the C executor, merged with the GPU's.

The C executor runs them while the GPU serves hits and fills; the two partial outputs are then
merged (paper §3.2, §4.1).

On CUDA, two mechanisms (``mode``); neither runs Python per step, so CUDA graphs capture them:
- ``doorbell`` (the default): the activations and the work items go into mapped pinned
  memory and a doorbell there is rung; a serving thread (``cpu.executor.Doorbell``) runs the C
  executor and writes the fp32 partial back into mapped memory, which the GPU awaits and adds
  (``kernels/doorbell.py``). Both ends are folded into kernels the layer call runs anyway
  (``fold``): the decision kernel posts (``post_target``, ``residency.decide(post=)``), and
  the MoE's sum over top-k, ours in place of SGLang's sum-reduce (``merging_reduce``), awaits
  the partial and adds it before its one rounding; each only on a call with CPU items, so a
  call without costs no kernel beyond the fill policy's. Where the MoE does not end in
  SGLang's general sum-reduce (top-k <= 2 at scale 1, its fused all-reduce sum, FreeToken's
  own FP4 kernels), ``merge`` launches a separate merge kernel, which returns at once
  without items.
- ``host-node``: the inputs are copied to pinned host buffers on the compute stream, a side
  stream calls ``ft_cpu_moe_run`` through ``cuLaunchHostFunc``, copies the partial back, and
  the compute stream waits for it before the merge; it runs on every layer call.
On a CPU device the executor runs in the calling thread, and not at all when a call has no
CPU item.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Dict, Optional

import torch

from freetoken_sglang.cache.residency import CpuWork

_libcuda = None

def _launch_host_func(stream: int, fn: int, data: int) -> None:
    """``cuLaunchHostFunc(stream, fn, data)`` (driver API; capturable into CUDA graphs)."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchHostFunc.restype = ctypes.c_int
        _libcuda = lib
    rc = _libcuda.cuLaunchHostFunc(stream, fn, data)
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")


class CpuBranch:
    """Stages a layer call's CPU work, runs it, and merges its partial output.

    Args:
        executor: the C executor over the host pool (``cpu.executor.CpuExpertExecutor``).
        device: the serving device.
        hidden_size: H.
        top_k: k.
        act_dtype: activation dtype of the layer inputs.
        max_rows: the most rows of one call: the pinned buffers are allocated once, at this
            size, and never move (captured graphs hold their addresses).
        mode: ``doorbell`` or ``host-node`` (CUDA only; see the module docstring).

    Attribute ``fold`` (True): the doorbell's post and merge run inside the decision kernel
    and the MoE's sum; False runs them as kernels of their own (``kernels/doorbell.py``
    ``post``, ``wait_merge``), as before they were folded: for A/B measurements
    (``benchmarks/bench_layer_overhead.py``).

    Raises:
        ValueError: an unknown ``mode``.
    """

    MODES = ("doorbell", "host-node")

    def __init__(
        self,
        executor,
        device: torch.device,
        hidden_size: int,
        top_k: int,
        act_dtype: torch.dtype,
        max_rows: int = 64,
        mode: str = "doorbell",
    ):
        if mode not in self.MODES:
            raise ValueError(f"CpuBranch mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self.doorbell = None
        self.fold = True
        self._folded = False  # the pending call's partial was merged by the MoE's sum
        self.calls = 0  # CPU-device runs of the executor (tests: skipped without items)
        self.closed = False
        self.executor = executor
        self.device = torch.device(device)
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.act_dtype = act_dtype
        self.max_rows = max_rows
        self._done: Optional[torch.cuda.Event] = None
        self._count = None
        self._partial: Optional[torch.Tensor] = None
        self.tasks: Dict[int, object] = {}
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self._entry = executor.task_entry_address
            self._allocate(max_rows)
            if mode == "doorbell":
                self._start_doorbell(max_rows)

    def _start_doorbell(self, rows: int, mapped: bool = True) -> None:
        """The doorbell's buffers and serving thread; ``mapped=False`` (Triton's interpreter,
        tests) keeps the host buffers unpinned and passes them as their own aliases."""
        from freetoken_sglang.cpu.executor import Doorbell
        from freetoken_sglang.experts.pool import HostExpertPool

        uva = HostExpertPool._uva_view if mapped else (lambda t: t)
        # int64 words: ring [0] and done [8] on lines of their own; n_rows [16] and status
        # [20] (int32), both written by the GPU, share one
        self.hdr_host = torch.zeros(24, dtype=torch.int64, device="cpu", pin_memory=mapped)
        self.nrows_host = self.hdr_host[16:17].view(torch.int32)[:1]
        self.seq_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.status_host = self.hdr_host[20:21].view(torch.int32)[:1]  # set by the merge kernel
        self._uva = {
            "x": uva(self.x_host), "rows": uva(self.rows_host),
            "experts": uva(self.experts_host), "weights": uva(self.weights_host),
            "count": uva(self.count_host), "n_rows": uva(self.nrows_host),
            "ring": uva(self.hdr_host[0:1]), "done": uva(self.hdr_host[8:9]),
            "out": uva(self.out_host), "status": uva(self.status_host),
        }
        self._door_task = self.executor.make_task(
            x_ptr=self.x_host.data_ptr(), x_dtype=self.act_dtype, n_rows=rows,
            rows_ptr=self.rows_host.data_ptr(), experts_ptr=self.experts_host.data_ptr(),
            weights_ptr=self.weights_host.data_ptr(), out_ptr=self.out_host.data_ptr(),
            n_items_ptr=self.count_host.data_ptr(), zero_output=True,
        )
        self.doorbell = Doorbell(self._door_task, self.nrows_host.data_ptr(),
                                 self.hdr_host[0:1].data_ptr(), self.hdr_host[8:9].data_ptr())
        import atexit

        atexit.register(self.close)  # the thread stops before CUDA frees the pinned buffers

    def close(self) -> None:
        """Stop the doorbell's serving thread (before the executor is closed); the branch
        refuses later calls."""
        if self.doorbell is not None:
            self.doorbell.stop()
            self.doorbell = None
            self.closed = True

    def _allocate(self, rows: int, pin: bool = True) -> None:
        H, n = self.hidden_size, rows * self.top_k
        pinned = dict(device="cpu", pin_memory=pin)
        self.x_host = torch.empty(rows, H, dtype=self.act_dtype, **pinned)
        self.rows_host = torch.zeros(n, dtype=torch.int32, **pinned)
        self.experts_host = torch.zeros(n, dtype=torch.int32, **pinned)
        self.weights_host = torch.zeros(n, dtype=torch.float32, **pinned)
        self.count_host = torch.zeros(1, dtype=torch.int32, **pinned)
        self.out_host = torch.zeros(rows, H, dtype=torch.float32, **pinned)
        if self.mode == "host-node":  # the doorbell's merge reads out_host in place
            self.out_dev = torch.zeros(rows, H, dtype=torch.float32, device=self.device)

    def _task(self, rows: int):
        task = self.tasks.get(rows)
        if task is None:
            task = self.executor.make_task(
                x_ptr=self.x_host.data_ptr(),
                x_dtype=self.act_dtype,
                n_rows=rows,
                rows_ptr=self.rows_host.data_ptr(),
                experts_ptr=self.experts_host.data_ptr(),
                weights_ptr=self.weights_host.data_ptr(),
                out_ptr=self.out_host.data_ptr(),
                n_items_ptr=self.count_host.data_ptr(),
                zero_output=True,
            )
            self.tasks[rows] = task
        return task

    def _check_call(self, x: torch.Tensor) -> None:
        if x.shape[0] > self.max_rows:
            raise RuntimeError(
                f"FreeToken CPU branch: a layer call of {x.shape[0]} rows, more than the "
                f"{self.max_rows} rows its buffers were sized for at start"
            )
        if self.closed:
            raise RuntimeError("FreeToken CPU branch: used after close()")

    def post_target(self, x: torch.Tensor):
        """Where the decision kernel posts this call's CPU work (``residency.decide(post=)``,
        then ``launch(..., posted=True)``), or None where it does not: not the doorbell mode
        on CUDA, or ``fold`` off.

        Args:
            x: ``[T, H]`` layer input.

        Returns:
            A ``kernels.doorbell.DoorbellPost`` or None.

        Raises:
            RuntimeError: more rows than ``max_rows``, or the branch is closed.
        """
        if self.device.type != "cuda" or self.mode != "doorbell" or not self.fold:
            return None
        self._check_call(x)
        from freetoken_sglang.kernels.doorbell import DoorbellPost

        return DoorbellPost(x, self.seq_dev, self._uva)

    def launch(self, x: torch.Tensor, work: CpuWork, posted: bool = False) -> None:
        """Start the CPU work of one layer call; ``merge`` collects it.

        Args:
            x: ``[T, H]`` layer input (copied before the GPU path may overwrite it in place).
            work: the call's CPU work items (``residency.decide``).
            posted: the decision kernel has posted them (``post_target``): nothing to launch.

        Raises:
            RuntimeError: more rows than ``max_rows``, the branch is closed, or ``posted``
                off the doorbell mode.
        """
        self._folded = False  # (a call that raised before its merge leaves none behind)
        if self.device.type != "cuda":
            n = int(work.count)
            out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32)
            if n:
                self.executor.run(x, work.rows[:n], work.experts[:n], work.weights[:n], out)
                self.calls += 1
            self._partial = out
            return
        rows = x.shape[0]
        self._check_call(x)
        if posted and self.doorbell is None:
            raise RuntimeError("FreeToken CPU branch: a posted call outside the doorbell mode")
        if self.doorbell is not None:
            if not posted:
                from freetoken_sglang.kernels import doorbell

                doorbell.post(x, work.rows, work.experts, work.weights, work.count,
                              self.seq_dev, self._uva)
            self._count = work.count
            return
        n = work.rows.numel()
        self.x_host[:rows].copy_(x, non_blocking=True)
        self.rows_host[:n].copy_(work.rows, non_blocking=True)
        self.experts_host[:n].copy_(work.experts, non_blocking=True)
        self.weights_host[:n].copy_(work.weights, non_blocking=True)
        self.count_host.copy_(work.count, non_blocking=True)
        staged = torch.cuda.Event()
        staged.record()
        self.stream.wait_event(staged)
        task = self._task(rows)
        with torch.cuda.stream(self.stream):
            _launch_host_func(self.stream.cuda_stream, self._entry, task.address)
            self.out_dev[:rows].copy_(self.out_host[:rows], non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(self.stream)
        self._partial = self.out_dev[:rows]

    @contextlib.contextmanager
    def merging_reduce(self):
        """Run the layer's GPU MoE inside this: for a doorbell call launched with ``fold`` on,
        the first SGLang sum-reduce it calls (swapped for the duration by
        ``patches/fused_moe.py``'s ``sum_reduce_replaced``) is ``kernels.doorbell.reduce_merge``,
        which also awaits and adds the CPU partial (one kernel in place of SGLang's; ``merge``
        then launches nothing); any later one runs as SGLang's. Otherwise it changes nothing.
        Python-level only (capture-safe): the kernels a graph records are decided here."""
        if self._count is None or not self.fold or self.doorbell is None:
            yield
            return
        from freetoken_sglang.kernels import doorbell
        from freetoken_sglang.patches.fused_moe import sum_reduce_replaced

        def replacing(original):
            def reduce(expert_out, out, scale):
                if self._count is None:  # merged already: SGLang's own sum
                    return original(expert_out, out, scale)
                doorbell.reduce_merge(expert_out, out, scale, self._count, self.seq_dev,
                                      self._uva["done"], self._uva["out"], self._uva["status"])
                self._count = None
                self._folded = True
            return reduce

        with sum_reduce_replaced(replacing):
            yield

    def merge(self, gpu_out: torch.Tensor) -> torch.Tensor:
        """Add the CPU partial (fp32 ``[T, H]``) to ``gpu_out`` (``[T, H]``, the layer dtype)
        in place, computing in fp32 (nothing where the MoE's sum merged it,
        ``merging_reduce``); returns ``gpu_out``."""
        if self._folded:
            self._folded = False
            return gpu_out
        if self._count is not None:
            from freetoken_sglang.kernels import doorbell

            rows = gpu_out.shape[0]
            doorbell.wait_merge(gpu_out, self._count, self.seq_dev, self._uva["done"],
                                self._uva["out"][:rows], self._uva["status"])
            self._count = None
            return gpu_out
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
            self._done = None
        gpu_out.add_(self._partial)
        self._partial = None
        return gpu_out

    def check(self) -> None:
        """Raise if a CPU executor run failed (its output was zeroed, so the step's result
        lacks that layer's CPU experts), or a merge gave up waiting for the doorbell thread.
        Call off the hot path, e.g. after each step.

        Raises:
            RuntimeError: naming the C error and the offending work item.
        """
        if self.doorbell is not None:
            from freetoken_sglang.cpu.executor import _strerror

            if self.doorbell.status != 0:
                raise RuntimeError(
                    "FreeToken: the CPU expert executor failed in a layer call: "
                    f"{_strerror(self.doorbell.status)} (item {self.doorbell.error_index})")
            if int(self.status_host[0]) != 0:
                raise RuntimeError(
                    "FreeToken: a layer call's merge gave up waiting for the CPU expert "
                    "executor (its doorbell thread did not answer)")
        for rows, task in self.tasks.items():
            if task.status != 0:
                from freetoken_sglang.cpu.executor import _strerror

                raise RuntimeError(
                    f"FreeToken: the CPU expert executor failed in a layer call of {rows} rows: "
                    f"{_strerror(task.status)} (item {task.error_index})"
                )
