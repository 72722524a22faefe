"""The CPU share of a streamed prefill, its data movement: the items, the pinned buffers and
the C executor's run from a CUDA host-function node (the rule: ``prefill_cpu_rule.py``)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from freetoken_sglang.execute.prefill_cpu_rule import PrefillCpuRule


class PrefillCpuPart:
    """Runs the CPU share of streamed layer calls with the C executor.

    On CUDA nothing waits on the host: the layer input rows and the items are copied to
    pinned host buffers on the compute stream; a side stream waits for them, runs the executor
    in a host-function node (``cuLaunchHostFunc``; the executor's threads compute while the
    GPU computes the streamed experts and the next copies go on) and copies the fp32 partial
    back; the compute stream waits for that copy and adds it. Python goes on launching the next
    layer meanwhile. On a CPU device the executor reads ``x`` in place, in the calling thread.

    Args:
        executor: the ``CpuExpertExecutor`` over the host pool.
        hidden_size: H.
        top_k: k.
        act_dtype: the layer inputs' dtype.
        device: the serving device.
        rule: the CPU share's rule.
        max_rows: the most rows of a forward: the pinned host buffers and the device
            partial are allocated at start for them (CUDA), before SGLang sizes its KV pool.
    """

    def __init__(self, executor, hidden_size: int, top_k: int, act_dtype: torch.dtype,
                 device: torch.device, rule: Optional[PrefillCpuRule] = None,
                 max_rows: int = 0):
        self.executor = executor
        self.rule = rule  # the rule in use (the stream executor calibrates it)
        self.H = hidden_size
        self.k = top_k
        self.act_dtype = act_dtype
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.rows_cap = 0
        self.tasks = {}  # (rows, layer) -> CpuMoeTask over the current buffers
        self.calls = 0
        self.cpu_s = 0.0  # executor time (CUDA: between timing events around the host node)
        self._timings = []  # (start, end, experts, tokens per expert) of queued runs
        self.observed = []  # (us per expert, tokens per expert, experts) of finished runs
        self._staged = None
        self._unchecked = False  # runs launched whose status check has not yet seen them end
        if self.on_cuda:
            self.stream = torch.cuda.Stream(self.device)
            if max_rows:
                self._ensure(max_rows)

    def _ensure(self, rows: int) -> None:
        """Pinned buffers for ``rows`` rows (grown to the next power of two; the previous
        buffers are released only after every queued use of them)."""
        if rows <= self.rows_cap:
            return
        if self.rows_cap:
            torch.cuda.current_stream(self.device).synchronize()
            self.stream.synchronize()
        cap = 1 << max(6, (rows - 1).bit_length())
        pinned = dict(device="cpu", pin_memory=True)
        n = cap * self.k
        self.x_host = torch.empty(cap, self.H, dtype=self.act_dtype, **pinned)
        self.rows_host = torch.arange(n, dtype=torch.int32) // self.k
        self.experts_host = torch.empty(n, dtype=torch.int32, **pinned)
        self.weights_host = torch.empty(n, dtype=torch.float32, **pinned)
        self.out_host = torch.empty(cap, self.H, dtype=torch.float32, **pinned)
        self.out_dev = torch.empty(cap, self.H, dtype=torch.float32, device=self.device)
        self.tasks = {}
        self.rows_cap = cap

    def _task(self, rows: int, ordinal: int):
        """The descriptor of layer ``ordinal``'s runs over ``rows`` rows: one per layer, so that
        a failed run's status stays until ``check`` reads it."""
        task = self.tasks.get((rows, ordinal))
        if task is None:
            if len(self.tasks) >= 256:  # drop the descriptors once no queued node reads them
                self.stream.synchronize()
                self.check()
                self.tasks = {}
            task = self.executor.make_task(
                x_ptr=self.x_host.data_ptr(), x_dtype=self.act_dtype, n_rows=rows,
                rows_ptr=self.rows_host.data_ptr(), experts_ptr=self.experts_host.data_ptr(),
                weights_ptr=self.weights_host.data_ptr(), out_ptr=self.out_host.data_ptr(),
                n_items=rows * self.k, zero_output=True,
            )
            self.tasks[(rows, ordinal)] = task
        return task

    @staticmethod
    def items(ordinal: int, num_experts: int, cpu_mask: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, scale: float):
        """The call's CPU items and the ids left to the GPU.

        Args:
            cpu_mask: bool ``[E]`` on the device, the layer's experts the CPU runs.
            topk_ids: int ``[T, k]`` local ids; topk_weights: fp32 ``[T, k]``.
            scale: the factor of the CPU partial (``slot_moe.routed_scale``).

        Returns:
            ``(experts, weights, gpu_ids)``: int32 ``[T*k]`` flat ids ``l*E + e`` or -1 (the
            GPU's entry), fp32 ``[T*k]`` weights, and ``[T, k]`` ids with -1 where the CPU
            serves the entry.
        """
        on_cpu = cpu_mask[topk_ids.long().clamp(min=0)] & (topk_ids >= 0)
        flat = torch.where(on_cpu, topk_ids.to(torch.int32) + ordinal * num_experts, -1)
        weights = topk_weights.float() * scale
        gpu_ids = torch.where(on_cpu, torch.full_like(topk_ids, -1), topk_ids)
        return flat.view(-1), weights.reshape(-1), gpu_ids

    def launch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
               rows: int, ordinal: int = 0, n_experts: int = 0,
               per_expert: float = 0.0) -> None:
        """Start the CPU items of the first ``rows`` rows of ``x`` (CUDA: the copies are
        queued on the compute stream before the GPU may overwrite ``x``); ``merge`` adds the
        partial.

        Args:
            x: ``[T, H]`` layer input (the layer dtype), ``T >= rows``.
            experts: int32 ``[T*k]`` flat ids or -1; weights: fp32 ``[T*k]`` (``items``).
            rows: the real rows; ordinal: the layer's MoE ordinal.
            n_experts, per_expert: the run's experts and tokens per expert, kept with its
                timing in ``observed`` for the rule's calibration.
        """
        n = rows * self.k
        if not self.on_cuda:
            self._staged = (x[:rows], experts[:n], weights[:n])
            return
        from freetoken_sglang.cpu.branch import _launch_host_func

        self._ensure(rows)
        self.x_host[:rows].copy_(x[:rows], non_blocking=True)
        self.experts_host[:n].copy_(experts[:n], non_blocking=True)
        self.weights_host[:n].copy_(weights[:n], non_blocking=True)
        staged = torch.cuda.Event()
        staged.record()
        self.stream.wait_event(staged)
        task = self._task(rows, ordinal)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            _launch_host_func(self.stream.cuda_stream, self.executor.task_entry_address,
                              task.address)
            end.record(self.stream)
            self.out_dev[:rows].copy_(self.out_host[:rows], non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        self._staged = (done, task)
        self._timings.append((start, end, n_experts, per_expert))
        self._unchecked = True
        self.calls += 1

    def merge(self, gpu_out: torch.Tensor, rows: int) -> torch.Tensor:
        """Add the launched call's fp32 partial to the first ``rows`` rows of ``gpu_out``
        (``[T, H]``, the layer dtype) in place, computing in fp32; returns ``gpu_out``.

        Raises:
            ValueError: the executor refused an item (a CPU device; on CUDA ``check``).
        """
        staged, self._staged = self._staged, None
        if not self.on_cuda:
            x, experts, weights = staged
            t0 = time.perf_counter()
            out = torch.zeros(rows, self.H, dtype=torch.float32)
            rows_of = torch.arange(rows * self.k, dtype=torch.int32) // self.k
            self.executor.run(x, rows_of, experts.contiguous(), weights.contiguous(), out)
            self.cpu_s += time.perf_counter() - t0
            self.calls += 1
            gpu_out[:rows].add_(out)
            return gpu_out
        done, _task = staged  # (the descriptor lives until its node has run)
        torch.cuda.current_stream().wait_event(done)
        gpu_out[:rows].add_(self.out_dev[:rows])  # (fp32 sum, rounded once to the layer dtype)
        return gpu_out

    def abandon(self) -> None:
        """A forward that ended between ``launch`` and ``merge`` (it raised): later work on
        the compute stream waits for that run, whose buffers the next launch reuses."""
        staged, self._staged = self._staged, None
        if staged is not None and self.on_cuda:
            torch.cuda.current_stream().wait_event(staged[0])

    def check(self) -> None:
        """Raise if a host-node run failed (its partial was zeroed), and add the finished
        runs' times to ``cpu_s``. After each step: returns at once when no run was launched
        since the last check that saw every run end (decode steps launch none).

        Raises:
            RuntimeError: naming the C error and the offending item.
        """
        if not self._unchecked:
            return
        from freetoken_sglang.cpu.executor import _strerror

        keep = []  # the timings first: a run seen to end here has its final status below
        for start, end, n, t in self._timings:
            if end.query():
                ms = start.elapsed_time(end)
                self.cpu_s += ms / 1e3
                if n > 0:
                    self.observed.append((ms * 1e3 / n, t, n))
            else:
                keep.append((start, end, n, t))
        self._timings = keep
        for (rows, ordinal), task in self.tasks.items():
            if task.status != 0:
                what = f"{_strerror(task.status)} (item {task.error_index})"
                task._struct.status = 0  # raised once
                raise RuntimeError(
                    "FreeToken: the CPU expert executor failed in a streamed prefill call of "
                    f"{rows} rows at MoE layer {ordinal}: {what}")
        self._unchecked = bool(keep)  # runs still queued: look again next time
