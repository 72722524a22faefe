"""The CPU share of a streamed prefill: how many of a layer's non-resident experts the C
executor runs instead of streaming them (the rule), and the data movement of that share.

Beyond the paper (§3.1 streams every non-resident expert of a prefill layer over PCIe): a
streamed layer is bound by its PCIe time, ``m * S / B_P`` for ``m`` non-resident experts of
``S`` bytes, while the CPU, which holds every expert, idles. The CPU share sends ``c`` of the
``m`` experts to the C executor and streams the rest, so the layer takes about
``max((m - c) * p, c * h)`` with ``p = S / B_P`` and ``h`` the CPU's time per expert. The
balance ``c * h = (m - c) * p`` gives ``c = round(m * p / (p + h))``, q*'s closed form with
the CPU's prefill cost in place of its decode bandwidth. The CPU's time per expert grows with
the tokens each expert gets, ``t = rows * k / E`` (the call's rows routed uniformly), so long
prefill chunks give the CPU little and short re-prefills (agent turns) much:

    h(t) = S / (B_H - B_P) + g * t

``S / (B_H - B_P)`` is Eq. 3's read time with PCIe fills drawing host-memory bandwidth at the
same time, and ``g`` the executor's compute time per (token, expert) item, measured on the
model's expert shape at start (``bandwidth.measure_executor_tokens``). While serving, ``p``
and ``g`` follow what the streamed copies and the CPU runs take (``calibrated``): the
streamed copies run at the copy engine's rate rather than the fill kernels' B_P, and the
executor computes slower beside the PCIe traffic than alone. Nothing is tuned. Which
experts go to the CPU is decided when a layer's copy is issued, before its routing is known:
the last ``c`` non-resident experts by index.
"""

from __future__ import annotations

from dataclasses import dataclass
import time
from typing import Optional

import torch

# Where B_H <= B_P the CPU has no residual bandwidth beside the fills (Eq. 3): no CPU share.
UNREACHABLE_US = 1e30


@dataclass(frozen=True)
class PrefillCpuRule:
    """How many of a streamed layer's non-resident experts run on the CPU.

    Attributes:
        share: a fixed fraction of the non-resident experts (``--freetoken-prefill-cpu F``),
            or None for the balance rule.
        p_us: one expert's PCIe time, ``S / B_P`` (us).
        h0_us: one expert's CPU read time beside the fills, ``S / (B_H - B_P)`` (us).
        g_us: the executor's compute time per (token, expert) item (us).
        top_k, num_experts: k and E, for the tokens per expert of a call.
    """

    share: Optional[float]
    p_us: float = 0.0
    h0_us: float = UNREACHABLE_US
    g_us: float = 0.0
    top_k: int = 1
    num_experts: int = 1

    @classmethod
    def balanced(cls, expert_bytes: int, b_p: float, b_h: float, g_us: float, top_k: int,
                 num_experts: int) -> "PrefillCpuRule":
        """The balance rule from measured B_P, B_H (GB/s) and g (us per item).

        Raises:
            ValueError: a non-positive bandwidth or a negative g.
        """
        if b_p <= 0 or b_h <= 0 or g_us < 0:
            raise ValueError(f"need B_P, B_H > 0 and g >= 0, got {b_p}, {b_h}, {g_us}")
        p = expert_bytes / (b_p * 1e3)  # bytes / (GB/s) in us
        h0 = expert_bytes / ((b_h - b_p) * 1e3) if b_h > b_p else UNREACHABLE_US
        return cls(None, p, h0, g_us, top_k, num_experts)

    def tokens_per_expert(self, rows: int) -> float:
        """Expected items per expert of a call over ``rows`` rows: ``rows * k / E``."""
        return rows * self.top_k / self.num_experts

    def cpu_count(self, missing: int, rows: int) -> int:
        """How many of a layer's ``missing`` non-resident experts the CPU runs in a streamed
        call over ``rows`` rows (0 <= result <= missing)."""
        if missing <= 0:
            return 0
        if self.share is not None:
            return min(missing, int(round(missing * self.share)))
        h = self.h0_us + self.g_us * self.tokens_per_expert(rows)
        if h >= UNREACHABLE_US:
            return 0
        return min(missing, int(round(missing * self.p_us / (self.p_us + h))))

    def calibrated(self, copies, runs, weight: float = 0.5) -> "PrefillCpuRule":
        """The balance rule moved towards what serving measured (a fixed share is kept):
        ``p`` towards the streamed copies' time per expert, ``g`` towards
        ``(run time per expert - h0) / t`` of the CPU runs with ``t >= 1``; each the mean of
        the observations (weighted by experts), mixed in with ``weight``.

        Args:
            copies: ``(us, experts)`` of finished layer copies.
            runs: ``(us per expert, tokens per expert, experts)`` of finished CPU runs.
        """
        if self.share is not None:
            return self
        p, g = self.p_us, self.g_us
        n = sum(e for _, e in copies)
        if n:
            p = (1 - weight) * p + weight * sum(us for us, _ in copies) / n
        runs = [(us, t, e) for us, t, e in runs if t >= 1.0]
        n = sum(e for _, _, e in runs)
        if n and self.h0_us < UNREACHABLE_US:
            obs = sum(max(0.0, (us - self.h0_us) / t) * e for us, t, e in runs) / n
            g = (1 - weight) * g + weight * obs
        return PrefillCpuRule(None, p, self.h0_us, g, self.top_k, self.num_experts)

    def describe(self) -> str:
        if self.share is not None:
            return f"{self.share:g} of each streamed layer's non-resident experts"
        if self.h0_us >= UNREACHABLE_US:
            return "none (B_H <= B_P: no host bandwidth left beside the fills)"
        return (f"balance rule (p {self.p_us:.1f} us, CPU {self.h0_us:.1f} us + "
                f"{self.g_us:.2f} us per token, per expert)")


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
    """

    def __init__(self, executor, hidden_size: int, top_k: int, act_dtype: torch.dtype,
                 device: torch.device, rule: Optional[PrefillCpuRule] = None):
        self.executor = executor
        self.rule = rule  # the rule in use (the stream executor calibrates it)
        self.H = hidden_size
        self.k = top_k
        self.act_dtype = act_dtype
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.rows_cap = 0
        self.tasks = {}  # rows -> CpuMoeTask over the current buffers
        self.calls = 0
        self.cpu_s = 0.0  # executor time (CUDA: between timing events around the host node)
        self._timings = []  # (start, end, experts, tokens per expert) of queued runs
        self.observed = []  # (us per expert, tokens per expert, experts) of finished runs
        self._staged = None
        if self.on_cuda:
            self.stream = torch.cuda.Stream(self.device)

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

    def _task(self, rows: int):
        task = self.tasks.get(rows)
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
            self.tasks[rows] = task
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
        on_cpu = cpu_mask[topk_ids.long()]
        flat = torch.where(on_cpu, topk_ids.to(torch.int32) + ordinal * num_experts, -1)
        weights = topk_weights.float() * scale
        gpu_ids = torch.where(on_cpu, torch.full_like(topk_ids, -1), topk_ids)
        return flat.view(-1), weights.reshape(-1), gpu_ids

    def launch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
               rows: int, n_experts: int = 0, per_expert: float = 0.0) -> None:
        """Start the CPU items of the first ``rows`` rows of ``x`` (CUDA: the copies are
        queued on the compute stream before the GPU may overwrite ``x``); ``merge`` adds the
        partial. ``n_experts`` and ``per_expert`` (the experts and the tokens each gets) go with
        the run's timing into ``observed``."""
        n = rows * self.k
        if not self.on_cuda:
            self._staged = (x[:rows], experts[:n], weights[:n])
            return
        from freetoken_sglang.cpu_branch import _launch_host_func

        self._ensure(rows)
        self.x_host[:rows].copy_(x[:rows], non_blocking=True)
        self.experts_host[:n].copy_(experts[:n], non_blocking=True)
        self.weights_host[:n].copy_(weights[:n], non_blocking=True)
        staged = torch.cuda.Event()
        staged.record()
        self.stream.wait_event(staged)
        task = self._task(rows)
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
            gpu_out[:rows] = (gpu_out[:rows].float() + out).to(gpu_out.dtype)
            return gpu_out
        done, task = staged
        torch.cuda.current_stream().wait_event(done)
        gpu_out[:rows] = (gpu_out[:rows].float() + self.out_dev[:rows]).to(gpu_out.dtype)
        return gpu_out

    def check(self) -> None:
        """Raise if a host-node run failed (its partial was zeroed), and add the finished
        runs' times to ``cpu_s``. Off the hot path (after a step, or the stats).

        Raises:
            RuntimeError: naming the C error and the offending item.
        """
        from freetoken_sglang.cpu_executor import _strerror

        for rows, task in self.tasks.items():
            if task.status != 0:
                raise RuntimeError(
                    f"FreeToken: the CPU expert executor failed in a streamed prefill call of "
                    f"{rows} rows: {_strerror(task.status)} (item {task.error_index})")
        keep = []
        for start, end, n, t in self._timings:
            if end.query():
                ms = start.elapsed_time(end)
                self.cpu_s += ms / 1e3
                if n > 0:
                    self.observed.append((ms * 1e3 / n, t, n))
            else:
                keep.append((start, end, n, t))
        self._timings = keep
