"""The per-process FreeToken runtime: builds the pool, the cache and the executors of one
scheduler at start, and holds the per-forward state they share.

Created when SGLang's ``ModelRunner`` starts loading a model with ``--enable-freetoken``
(``patches/model_runner.py``); the MoE layers built during that load register with it, and
``finish_load`` pins the pool and allocates the cache before SGLang sizes its KV pool. Layer
calls go to the executors (``execute/``); the stats document is ``observe/document.py``.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Dict, Optional

import torch

from freetoken_sglang import families
from freetoken_sglang.cache.layout import RESIDENT, SlotLayout, plan_layout
from freetoken_sglang.cache.residency import FILL_ALL, MissSplit
from freetoken_sglang.cache.slots import (
    CUDA_NULL_SLOTS,
    CacheSize,
    ExpertCache,
    resolve_num_slots,
)
from freetoken_sglang.config import RULE_WORDS, SERVER_ARGS_ATTR, FreeTokenConfig
from freetoken_sglang.errors import RefusedError
from freetoken_sglang.execute.choice import DECODE, EXTEND, ExecutorChoice, stream_min_rows
from freetoken_sglang.policy.miss import SPLIT_MAX_TOKENS, MissPolicy
from freetoken_sglang.policy.words import PolicyWords
from freetoken_sglang.observe.counters import ExpertCounters
from freetoken_sglang.experts.pool import GIB, BankSpec, HostExpertPool, pool_fits_host

logger = logging.getLogger(__name__)

_RUNTIME: Optional["FreeTokenRuntime"] = None


def get_runtime() -> Optional["FreeTokenRuntime"]:
    """The runtime of this process, or None when FreeToken is not serving here."""
    return _RUNTIME


def config_of(server_args) -> Optional[FreeTokenConfig]:
    """The FreeToken config carried by ``server_args`` (None: FreeToken is off)."""
    return getattr(server_args, SERVER_ARGS_ATTR, None)


def _tokenizer(server_args):
    """The model's tokenizer (transformers; SGLang's own ``get_tokenizer`` options)."""
    from sglang.srt.utils.hf_transformers import get_tokenizer

    return get_tokenizer(
        server_args.tokenizer_path,
        tokenizer_mode=server_args.tokenizer_mode,
        trust_remote_code=server_args.trust_remote_code,
        tokenizer_revision=server_args.revision,
    )


class FreeTokenRuntime:
    """Pool, cache, counters and per-step shared tensors of one model runner.

    Args:
        config: the parsed flags.
        model_runner: SGLang's ``ModelRunner`` about to load the model.

    Raises:
        UnsupportedModelError: the architecture or checkpoint format is not supported.
    """

    def __init__(self, config: FreeTokenConfig, model_runner):
        self.config = config
        self.server_args = model_runner.server_args
        hf_config = model_runner.model_config.hf_config
        self.family, _ = families.family_of(hf_config)
        self.moe_layer_ids = families.moe_layer_ids(hf_config)
        self.num_experts = families.num_routed_experts(hf_config)
        self.top_k = families.top_k(hf_config)
        self.hf_config = hf_config
        device = model_runner.device
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        self.device = torch.device(device)
        self.pool: Optional[HostExpertPool] = None
        self.pool_initial_values: Dict[str, float] = {}  # the format's (pool_for_layer)
        self.cache: Optional[ExpertCache] = None
        self.counters: Optional[ExpertCounters] = None
        self.layers: Dict[int, object] = {}
        self.backend = config.backend
        self.policy: Optional[MissPolicy] = None
        self.bandwidth = None
        self.executor = None
        self.cpu_branch = None
        # The CPU share of streamed prefill (--freetoken-prefill-cpu; execute/prefill_cpu.py).
        self.prefill_cpu_part = None
        self.recorder = None
        self.replay = None  # --freetoken-replay-routing (benchmarks only)
        self.choice: Optional[ExecutorChoice] = None
        self.executors: Dict[str, object] = {}
        # Phase of the forward in flight (decode / extend), set per forward and during
        # graph capture; None falls back to the row count.
        self.phase: Optional[str] = None
        # True while SGLang captures CUDA graphs (patches/cuda_graph.py).
        self.capturing = False
        # Forwards seen per mode (decode, extend, mixed), for the stats document.
        self.forwards = {"decode": 0, "extend": 0, "mixed": 0}
        self.act_dtype = model_runner.model_config.dtype
        self.model_path = model_runner.server_args.model_path
        # Real rows of the current forward; rows past it are graph padding.
        self.num_valid = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.load_report: Dict[str, float] = {}
        # Resizes while serving (resize_cache): the model runner whose graphs are captured
        # again, the size the flags gave, and what the last resize did.
        self.model_runner = None
        self.configured_slots = 0
        self.resizes = 0
        self.slack_bytes = 0  # SGLang's runtime slack (1 - mem_fraction_static), kept free
        self.serving_free_bytes: Optional[int] = None  # free when serving began
        self.shrink_floor_bytes: Optional[int] = None  # cache.resize.shrink_floor, lowest
        self.resize_answers: Dict[int, Dict[str, object]] = {}  # by request id, the last few
        self.last_resize: Optional[Dict[str, object]] = None
        self._next_watch = 0.0
        self.stream_carry: Dict[str, float] = {}
        # Semantic anchors (hybrid models; anchors/): markers now, states once the
        # scheduler's radix cache exists (patches/scheduler.py).
        self.anchors = None
        if config.anchors_enabled(families.is_hybrid(hf_config)):
            from freetoken_sglang.anchors.book import Anchors

            self.anchors = Anchors.from_tokenizer(
                _tokenizer(self.server_args), config.anchor_marker_list(),
                config.anchor_min_distance, config.anchor_states, config.anchor_cuts,
            )

    # ---- model build --------------------------------------------------------------------
    def pool_for_layer(self, layer, num_experts: int, specs: Dict[str, BankSpec],
                       initial_values: Optional[Dict[str, float]] = None) -> HostExpertPool:
        """The pool, allocated on the first MoE layer; later layers must match its banks.
        Where SGLang padded the experts' intermediate size beyond the checkpoint's (its CPU
        engine aligns it, ``configs/update_config.py``), a loader may write only the
        checkpoint's part of each row (GPT-OSS's MXFP4 loader does), so the banks start from
        the values SGLang's method gives its parameters (``initial_values``, else 0).

        Raises:
            UnsupportedModelError: a layer that is not an MoE layer of the family rule, or
                whose expert shapes differ from the first layer's.
        """
        if layer.layer_id not in self.moe_layer_ids:
            raise families.UnsupportedModelError(
                f"{self.family}: layer {layer.layer_id} built a FusedMoE, but the family "
                f"rule lists MoE layers {self.moe_layer_ids}"
            )
        if self.pool is None:
            if num_experts != self.num_experts:
                raise families.UnsupportedModelError(
                    f"{self.family}: FusedMoE has {num_experts} experts but the config "
                    f"says {self.num_experts}"
                )
            self.pool = HostExpertPool(self.moe_layer_ids, num_experts, specs)
            self.pool_initial_values = dict(initial_values or {})
            problem = pool_fits_host(self.pool.nbytes)
            if problem:
                raise MemoryError(f"--enable-freetoken: {problem}")
            # SGLang's padded expert sizes keep the checkpoint's as original_<name> (set on
            # this config object before the model is built)
            if any(hasattr(self.hf_config, "original_" + name)
                   for name in ("intermediate_size", "moe_intermediate_size")):
                for name, bank in self.pool.banks.items():
                    bank.fill_((initial_values or {}).get(name, 0))
            logger.info("FreeToken: host expert pool %s", self.pool.describe())
        elif specs != self.pool.specs or num_experts != self.pool.num_experts:
            raise families.UnsupportedModelError(
                f"{self.family}: MoE layer {layer.layer_id} has expert shapes {specs}, "
                f"unlike the first MoE layer's {self.pool.specs}"
            )
        return self.pool

    def check_cpu_activation(self, moe_runner_config) -> None:
        """Refuse, while the model is built, a MoE activation the C executor lacks when it will
        run experts: a clamped silu without ``gemm1_alpha`` (SGLang's ``gemm1_clamp_limit`` or
        ``swiglu_limit`` alone; GPT-OSS's alpha form is served).

        Raises:
            families.UnsupportedModelError: naming the flags that avoid the executor.
        """
        cfg = moe_runner_config
        uses_cpu = self.backend == "cpu" or self.config.miss_policy != "fill"
        if uses_cpu and cfg.gemm1_alpha is None and (
            cfg.gemm1_clamp_limit is not None or cfg.swiglu_limit is not None
        ):
            fix = ("--freetoken-backend gpu --freetoken-miss-policy fill" if self.backend == "cpu"
                   else "--freetoken-miss-policy fill")
            raise families.UnsupportedModelError(
                f"--enable-freetoken: {self.family}: the CPU expert executor has no clamped "
                f"silu without gemm1_alpha (this config sets gemm1_clamp_limit or "
                f"swiglu_limit); use {fix}"
            )

    def register_layer(self, layer, method) -> None:
        self.layers[layer.layer_id] = method

    def finish_load(self, model_runner, load_seconds: float, peak_load_bytes: int) -> None:
        """Pin the pool, choose the backend and miss policy, size and allocate the cache, and
        start the CPU executor; log what was built.

        Raises:
            UnsupportedModelError: not every MoE layer was built through FreeToken.
            CacheSizeError: the cache cannot serve one layer call, or does not fit.
        """
        built = sorted(self.layers)
        if built != self.moe_layer_ids or self.pool is None:
            raise families.UnsupportedModelError(
                f"{self.family}: FreeToken served the MoE layers {built}, but the model "
                f"has MoE layers {self.moe_layer_ids}"
            )
        sa = model_runner.server_args
        self._check_prefill_graph(sa)
        if self.config.min_free_gb is not None and self.device.type != "cuda":
            raise RefusedError(
                "--freetoken-min-free-gb watches the GPU's free memory and needs a CUDA "
                "device; drop it here"
            )
        # The most rows one forward can carry (prefill chunks, decode batches).
        max_tokens = max(
            sa.max_prefill_tokens or 0,
            sa.chunked_prefill_size or 0,
            sa.max_running_requests or 0,
            1,
        )
        # -- FTW (--freetoken-ftw): the pool's banks from the converted directory, before the pin
        ftw_report = {}
        if getattr(self.config, "ftw", None):
            from freetoken_sglang.experts import ftw

            ftw_report = ftw.load_for_runtime(self, model_runner)
        # -- end FTW
        t0 = time.perf_counter()
        pinned = False
        if self.device.type == "cuda" and self.backend == "gpu":
            pinned = self.pool.pin()
            if not pinned:
                code = self.pool.pin_error_code
                fix = (
                    "raise the memlock limit (`ulimit -l unlimited`; LimitMEMLOCK=infinity "
                    "under systemd, --ulimit memlock=-1 under docker) or pass "
                    if code == 2  # cudaErrorMemoryAllocation: the OS would not lock more
                    else "pass "
                )
                raise RefusedError(
                    f"CUDA could not page-lock the {self.pool.nbytes / GIB:.1f} GiB host "
                    f"expert pool ({self.pool.pin_error}), and the GPU expert cache fills "
                    f"only from pinned memory: {fix}--freetoken-backend cpu to run every "
                    "routed expert on the CPU"
                )
        pin_s = time.perf_counter() - t0

        if self.backend == "cpu":
            size = CacheSize(0, "--freetoken-backend cpu: no GPU expert cache")
            layout = SlotLayout(0, 0, 0, 0, "none")
        else:
            reason = f"one token's top-k experts (k={self.top_k}); larger calls run in waves"
            free_bytes = slack = None
            if self.device.type == "cuda":
                free_bytes = torch.cuda.mem_get_info(self.device)[0]
                before_gb = getattr(model_runner, "pre_model_load_memory", None)
                if before_gb is None:
                    before_gb = (
                        torch.cuda.get_device_properties(self.device).total_memory / GIB
                    )
                slack = int(before_gb * GIB * (1 - sa.mem_fraction_static))
                method = self.layers[self.moe_layer_ids[0]]  # its FreeTokenMoEMethod
                if method.triton_quant is not None and method.triton_quant.dequantized:
                    from freetoken_sglang.execute.slot_moe import DEQUANTIZED_SCRATCH_BYTES

                    slack += DEQUANTIZED_SCRATCH_BYTES  # FP4 calls' dequantized experts
                self.slack_bytes = slack
                if self._null_slots_on_cuda():
                    slack += CUDA_NULL_SLOTS * self.pool.expert_bytes  # after the slots
            size = resolve_num_slots(
                self.config, self.pool, self.top_k, reason, free_bytes, slack or 0
            )
            layout = self._plan_layout(size.num_slots)
        t1 = time.perf_counter()
        self.cache = self._new_cache(layout)
        self.model_runner = model_runner
        self.configured_slots = size.num_slots
        self.counters = ExpertCounters(self.moe_layer_ids, self.device)
        alloc_s = time.perf_counter() - t1
        self._start_cpu_side(max_tokens)
        if self.device.type == "cuda":
            # The decision kernel's q tables, before any CUDA graph is captured.
            from freetoken_sglang.kernels.residency import q_table

            for split in {self.policy.decode_split, self.policy.split_for(1, decode=False),
                          FILL_ALL, MissSplit(0.0, 0)}:
                q_table(split, self.num_experts, self.device)
        self._start_executors()
        if self.config.record_routing:
            from freetoken_sglang.observe.routing_recorder import RoutingRecorder

            self.recorder = RoutingRecorder(
                self.config.record_routing,
                len(self.moe_layer_ids),
                self.num_experts,
                self.top_k,
                self.device,
                max_tokens,
                meta={"model": self.model_path, "synthetic": False, "family": self.family},
            )
        if self.config.replay_routing:
            from freetoken_sglang.observe.routing_replay import RoutingReplay

            self.replay = RoutingReplay(
                self.config.replay_routing, len(self.moe_layer_ids), self.num_experts,
                self.top_k, self.device, self.config.replay_phase,
            )
            logger.warning("FreeToken: %s", self.replay.describe())
        self.load_report = {
            "load_seconds": load_seconds,
            "pin_seconds": pin_s,
            "cache_alloc_seconds": alloc_s,
            "peak_gpu_bytes_during_load": peak_load_bytes,
            "pool_bytes": self.pool.nbytes,
            "cache_bytes": self.cache.nbytes,
            "pinned": pinned,
            **ftw_report,  # FTW: its load time, bytes, threads and I/O mode
        }
        logger.info(
            "FreeToken: %s, routed experts in host memory (%s); backend %s; GPU expert "
            "cache: %s (size: %s); decode misses: %s. Peak GPU memory during load: %.2f "
            "GiB; pinning took %.2f s. %s%s",
            self.family,
            self.pool.describe(),
            self.backend
            if self.device.type == "cuda"
            else f"{self.backend} (a CPU device: the slot pool is in host memory)",
            self.cache.describe(),
            size.reason,
            self.describe_policy(),
            peak_load_bytes / GIB,
            pin_s,
            self.describe_prefill(),
            self.describe_fp4(),
        )

    def describe_fp4(self) -> str:
        """The FP4 kernels' sentence of the start-up log (``--freetoken-fp4-kernels``), or ""
        where the experts are not FP4 in a GPU cache on CUDA."""
        if self.cache is None or not self.moe_layer_ids or self.backend != "gpu" \
                or self.device.type != "cuda":
            return ""
        tq = self.layers[self.moe_layer_ids[0]].triton_quant
        if tq is None or not tq.dequantized:
            return ""
        from freetoken_sglang.execute.slot_moe import DIRECT_FP4_MAX_PAIRS

        if tq.fp4:
            return (f" FP4 experts: calls of at most {DIRECT_FP4_MAX_PAIRS} (token, expert) "
                    "pairs read the codes in their slots (--freetoken-fp4-kernels direct), "
                    "larger ones run SGLang's Triton MoE over dequantized slots.")
        return (" FP4 experts: every call runs SGLang's Triton MoE over dequantized slots "
                "(--freetoken-fp4-kernels dequantized).")

    def _plan_layout(self, num_slots: int) -> SlotLayout:
        """The split of ``num_slots`` slot rows the flags ask for (``cache/layout.py``)."""
        return plan_layout(
            num_slots,
            self.num_experts,
            self.pool.num_rows,
            self.top_k,
            0 if self.config.prefill == "lru" else self.config.stream_buffers,
            borrow=self.config.prefill_buffers == "borrowed",
        )

    def _new_cache(self, layout: SlotLayout) -> ExpertCache:
        if self.device.type == "cpu":
            null_slots = self.top_k  # SGLang's native MoE skips entries by distinct zero rows
        else:  # the row a decode call's CPU-served entries read (ExpertCache.null_slot)
            null_slots = (CUDA_NULL_SLOTS if self._null_slots_on_cuda() and layout.total
                          and layout.kind != RESIDENT else 0)
        return ExpertCache(self.pool, layout, self.device, null_slots)

    def _null_slots_on_cuda(self) -> bool:
        """Whether a CUDA cache keeps the null slot (``execute/decode.py``'s
        ``CPU_ENTRIES_READ_NULL_SLOT``): a server that can run experts on the CPU (not started
        with ``fill``, which never gets a CPU branch) over experts SGLang's Triton kernels
        read in their slots (not FP4, whose paths skip CPU entries themselves)."""
        if self.config.miss_policy == "fill" or not self.moe_layer_ids:
            return False
        tq = self.layers[self.moe_layer_ids[0]].triton_quant
        return tq is not None and not tq.dequantized

    def _check_prefill_graph(self, sa) -> None:
        """Refuse a prefill CUDA-graph backend that cannot run the streamed prefill (it needs
        the breakable backend's eager breaks), as SGLang resolved it (``--cuda-graph-config``
        and SGLang's own compatibility switches included).

        Raises:
            ValueError: naming the backend and the fix.
        """
        if self.device.type != "cuda" or self.backend != "gpu" or self.config.prefill != "stream":
            return
        graphs = getattr(sa, "cuda_graph_config", None)
        backend = getattr(getattr(graphs, "prefill", None), "backend", None)
        if backend not in (None, "breakable", "disabled"):
            raise ValueError(
                f"--enable-freetoken: the prefill CUDA graph backend resolved to {backend!r}, "
                "which cannot run the streamed prefill (it needs the breakable backend's eager "
                "breaks): use --cuda-graph-backend-prefill breakable, "
                "--disable-prefill-cuda-graph, or --freetoken-prefill lru"
            )

    def _start_cpu_side(self, max_tokens: int) -> None:
        """Start the C executor and the CPU branch when some misses run on the CPU, and
        resolve B_P / B_H for the q* policy."""
        from freetoken_sglang.policy.miss import SPLIT_MAX_TOKENS

        name = "cpu" if self.backend == "cpu" else self.config.miss_policy
        prefill_cpu = self.backend == "gpu" and self.config.prefill_cpu != "off"
        if name == "fill" and not prefill_cpu:
            self.policy = MissPolicy("fill")
            return
        from freetoken_sglang.cpu.branch import CpuBranch
        from freetoken_sglang.cpu.executor import CpuExpertExecutor, IsaNotSupportedError

        method = self.layers[self.moe_layer_ids[0]]  # its FreeTokenMoEMethod
        cfg = method.moe_runner_config
        # GPT-OSS's swiglu (gemm1_alpha, clamp limit, interleaved gate/up rows), as SGLang's
        # Triton runner reads them (``triton_utils/fused_moe.py`` in 0.5.17): the layout flag
        # matters only with gemm1_alpha; without it a gated MLP has gate rows, then up rows.
        alpha = cfg.gemm1_alpha
        try:
            self.executor = CpuExpertExecutor(
                self.pool.banks,
                activation=cfg.activation,
                num_threads=self.config.cpu_threads,
                isa=self.config.cpu_isa,
                gemm1_alpha=alpha,
                gemm1_limit=cfg.gemm1_clamp_limit if alpha is not None else None,
                gate_up_interleaved=bool(cfg.gate_up_interleaved) if alpha is not None else False,
                **method.format.executor_kwargs(method.base_method),
            )
        except IsaNotSupportedError as exc:  # (the flag check refuses this earlier)
            from freetoken_sglang.config import cpu_isa_problem

            raise RefusedError(cpu_isa_problem(self.config.cpu_isa) or str(exc)) from None
        if self.config.cpu_isa == "amx" and not self.executor.tiled:
            ex, self.executor = self.executor, None
            what = f"{ex.weight_format}, H={ex.hidden_size}, I={ex.intermediate_size}"
            ex.close()
            raise RefusedError(
                "--freetoken-cpu-isa amx: AMX tiles need dense BF16 experts with hidden and "
                f"intermediate sizes multiples of 32 (these: {what}); drop the flag")
        if prefill_cpu:
            self._start_prefill_cpu(max_tokens)
        if name == "fill":
            self.policy = MissPolicy("fill")
            return
        rows = max_tokens if self.backend == "cpu" else SPLIT_MAX_TOKENS
        self.cpu_branch = CpuBranch(
            self.executor,
            self.device,
            self.pool.specs["w2_weight"].shape[0],
            self.top_k,
            self.act_dtype,
            max_rows=rows,
            # the CPU backend hands whole prefill chunks to the executor: the copy engine's
            # staging copies suit them, the doorbell's one-CTA post kernel does not
            mode="host-node" if self.backend == "cpu" else self.config.cpu_branch,
        )
        if name == "qstar":
            words = PolicyWords(**{key: getattr(self.config, key)
                                   for key in ("miss_policy", *RULE_WORDS)})
            bw = self._resolve_bandwidth(beside=words.host_rates == "beside")
            self.policy = words.policy(bw, self.pool.expert_bytes)
        else:
            self.policy = MissPolicy("cpu")

    def _resolve_bandwidth(self, beside: bool = False):
        """B_P and B_H (and the fixed costs): the flag, the cached profile or a measurement;
        with ``beside``, B_P' and B_H' too where the flag does not leave them out
        (``policy.rates.resolve``)."""
        from freetoken_sglang.policy import rates

        lacks = (self.bandwidth is not None and beside and self.bandwidth.b_p_beside is None
                 and self.config.bandwidth is None)
        if self.bandwidth is None or lacks:
            self.bandwidth = rates.resolve(
                self.config.bandwidth,
                self.pool,
                self.executor,
                self.device,
                self.pool.specs["w2_weight"].shape[0],
                self.act_dtype,
                beside=beside,
            )
        return self.bandwidth

    def _start_prefill_cpu(self, max_tokens: int) -> None:
        """The CPU share of streamed prefill (``execute/prefill_cpu.py``): the rule, from the
        flag's fraction or from B_P, B_H and the executor's measured cost per token, and the
        pinned buffers' owner."""
        from freetoken_sglang.execute.prefill_cpu import PrefillCpuPart
        from freetoken_sglang.execute.prefill_cpu_rule import PrefillCpuRule
        from freetoken_sglang.policy import rates

        text = self.config.prefill_cpu
        if text == "auto":
            bw = self._resolve_bandwidth()
            g = rates.resolve_token_cost(
                self.pool, self.executor, self.device, self.pool.specs["w2_weight"].shape[0],
                self.act_dtype)
            rule = PrefillCpuRule.balanced(
                self.pool.expert_bytes, bw.b_p, bw.b_h, g, self.top_k, self.num_experts)
        else:
            rule = PrefillCpuRule(float(text), top_k=self.top_k, num_experts=self.num_experts)
        self.prefill_cpu_part = PrefillCpuPart(
            self.executor, self.pool.specs["w2_weight"].shape[0], self.top_k, self.act_dtype,
            self.device, rule, max_rows=max_tokens)

    @property
    def prefill_cpu_rule(self):
        """The CPU share's rule in use (calibrated while serving), or None when off."""
        return None if self.prefill_cpu_part is None else self.prefill_cpu_part.rule

    def _start_executors(self) -> None:
        """Build the executors the layout can use and the rule that picks one per call."""
        from freetoken_sglang.execute.cpu_backend import CpuBackendExecutor
        from freetoken_sglang.execute.decode import DecodeExecutor
        from freetoken_sglang.execute.prefill_stream import PrefillStreamExecutor
        from freetoken_sglang.execute.resident import ResidentExecutor
        from freetoken_sglang.execute.waves import WaveExecutor

        layout = self.cache.layout
        min_rows = self.config.stream_min_tokens or stream_min_rows(
            self.num_experts, self.top_k
        )
        self.choice = ExecutorChoice(
            backend=self.backend,
            layout_kind=layout.kind,
            lru_slots=layout.lru_slots,
            num_experts=self.num_experts,
            top_k=self.top_k,
            stream_min_rows=min_rows,
            prefill=self.config.prefill,
        )
        if self.backend == "cpu":
            self.executors = {"cpu": CpuBackendExecutor(self)}
            return
        if layout.kind == "resident":
            self.executors = {"resident": ResidentExecutor(self)}
            return
        self.executors = {"decode": DecodeExecutor(self)}
        if layout.kind == "stream":
            self.executors["stream"] = PrefillStreamExecutor(self)
        if layout.buffer_rows:
            self.executors["waves"] = WaveExecutor(self)

    def executor_for(self, rows: int):
        """The executor of a layer call over ``rows`` rows in the forward in flight.

        Raises:
            RuntimeError: a call that would go through the LRU while a streamed forward has
                slots lent out as its buffers (every layer call of a forward has the same rows,
                so this cannot happen unless a forward mixes executors).
        """
        phase = self.phase or (EXTEND if rows > SPLIT_MAX_TOKENS else DECODE)
        name = self.choice.executor_for(rows, phase)
        stream = self.executors.get("stream")
        if name != "stream" and stream is not None and stream.lent:
            raise RuntimeError(
                f"FreeToken: a {name} layer call of {rows} rows inside a streamed forward "
                "that has borrowed LRU slots; use --freetoken-prefill-buffers reserved"
            )
        return self.executors[name]

    def describe_prefill(self) -> str:
        c = self.choice
        if c.backend == "cpu" or c.layout_kind == "resident":
            unused = ("; --freetoken-prefill-cpu has no effect while every expert is resident"
                      if self.prefill_cpu_part is not None else "")
            return f"Prefill: no streaming (nothing to stream){unused}."
        if c.prefill == "lru":
            return "Prefill: through the decode LRU (--freetoken-prefill lru)."
        how = "full layers" if c.layout_kind == "stream" else "waves"
        if self.cache.layout.borrowed:
            how += ", buffers borrowed from the LRU's oldest slots"
        src = "--freetoken-stream-min-tokens" if self.config.stream_min_tokens else "crossover rule"
        text = (
            f"Prefill: layer calls of at least {c.stream_min_rows} rows stream ({how}; "
            f"{src}), without LRU fills"
        )
        if self.prefill_cpu_rule is not None:
            text += "; CPU share: " + (
                self.prefill_cpu_rule.describe() if c.layout_kind == "stream"
                else "none: prefill runs in waves, the cache being smaller than the two full "
                "layers plus top-k slots that streaming needs")
        return text + "."

    def begin_forward(self, phase: str, num_tokens: int, mixed: bool = False) -> None:
        """Before a forward of ``phase`` (``decode`` or ``extend``; ``mixed``: an extend
        forward that carries decode rows too) over ``num_tokens`` rows: record the phase, and
        start streaming the first layers when this forward's layer calls will stream."""
        self.phase = phase
        self.forwards["mixed" if mixed else phase] += 1
        stream = self.executors.get("stream")
        if stream is not None:
            streams = self.choice.executor_for(num_tokens, phase) == "stream"
            stream.begin_forward(prefetch=streams, rows=num_tokens)

    def end_forward(self) -> None:
        """After a forward (also one that raised): forget its phase and its streaming
        state, so that no later layer call can reuse its residency snapshot."""
        self.phase = None
        if self.cache is not None and self.cache.late is not None:
            self.cache.late.join()  # a forward that raised before its last MoE layer
        stream = self.executors.get("stream")
        if stream is not None:
            stream.end_forward()

    def _isa_text(self) -> str:
        """The executor's kernel path for the start-up log (with its tile threshold)."""
        ex = self.executor
        if ex.tiled:
            return f"{ex.isa} (AMX tiles for experts of at least {ex.tile_min} tokens in a call)"
        return ex.isa

    def describe_policy(self) -> str:
        if self.backend == "cpu":
            return (f"every routed expert on the CPU ({self.executor.num_threads} threads, "
                    f"{self._isa_text()})")
        text = self.policy.describe()
        if self.bandwidth is not None and self.policy.name == "qstar":
            text += f" [bandwidths from {self.bandwidth.source}]"
        if self.executor is not None:
            text += f"; CPU executor: {self.executor.num_threads} threads, {self._isa_text()}"
        return text

    @staticmethod
    def is_decode_sized(num_tokens: int) -> bool:
        """Layer calls this small are counted as decode (they split their misses)."""
        from freetoken_sglang.policy.miss import SPLIT_MAX_TOKENS

        return num_tokens <= SPLIT_MAX_TOKENS

    def split_for(self, num_tokens: int) -> MissSplit:
        """How a decode-executor layer call over ``num_tokens`` rows serves its misses (the
        late fill only in decode forwards, whose graphs are whole: its side stream joins at
        the last MoE layer)."""
        return self.policy.split_for(num_tokens, decode=self.phase == "decode")

    # ---- serving ------------------------------------------------------------------------
    def set_num_valid(self, num_tokens: int) -> None:
        """Record the real rows of the forward about to run (no host sync)."""
        self.num_valid.fill_(num_tokens)

    def end_step(self, phase: str, num_tokens: int) -> None:
        """After a forward step: raise if a CPU expert run failed, append the step's routing
        to the trace when recording, and move the routing replay on."""
        if self.cpu_branch is not None:
            self.cpu_branch.check()
        if self.prefill_cpu_part is not None:
            self.prefill_cpu_part.check()
        if self.recorder is not None:
            self.recorder.end_step(phase, num_tokens)
        if self.replay is not None:
            self.replay.advance(num_tokens)

    def reset_cache(self) -> None:
        """Empty the cache and zero the counters (after graph capture ran dummy batches; a
        resize restores its counters afterwards)."""
        if self.cache is not None:
            self.cache.reset()
        if self.counters is not None:
            self.counters.reset()
        for ex in self.executors.values():
            if hasattr(ex, "reset"):
                ex.reset()
        if self.replay is not None:
            self.replay.reset()

    # ---- resize (cache/resize.py) ---------------------------------------------------------
    def resize_cache(self, slots: Optional[int] = None, gb: Optional[float] = None,
                     reason: str = "request", miss_policy: Optional[str] = None,
                     admission: Optional[str] = None,
                     fill_reused: Optional[str] = None,
                     return_rule: Optional[str] = None,
                     late_fill: Optional[str] = None,
                     host_rates: Optional[str] = None) -> "ResizeReport":
        """Grow or shrink the GPU expert cache to ``slots`` slots (or ``gb`` GiB, rounded down
        to whole slots), at a scheduler safe point: no forward may be in flight. Keeps the
        most recently used experts that fit, frees the old slot banks before allocating the
        new ones (GPU memory goes back to the device), re-captures SGLang's CUDA graphs and
        keeps the counters. Paper §2.3, §3.3. With ``miss_policy`` (``fill``, ``qstar``,
        ``cpu``; ``admission`` ``off``/``reuse``/``useful``, ``fill_reused`` and ``return_rule``
        ``off``/``on``, ``late_fill`` ``off``/``on``/``all``, ``host_rates``
        ``alone``/``beside``, as the flags), the decode miss policy changes at the same point (no size: the same size);
        a rule given alone changes the current q*'s.

        Raises:
            ValueError: no GPU expert cache (``--freetoken-backend cpu``), both or neither of
                ``slots`` and ``gb`` (and no policy), a size under top-k, or one that does not
                fit in free device memory, a policy word its flag does not list
                (``PolicyWords``), or a policy this server cannot run (``_policy_for``); the
                cache and the policy are then unchanged.
        """
        from freetoken_sglang.cache.resize import (ResizeReport, check_invariants,
                                                   kept_experts, kept_fill_clocks)

        t0 = time.perf_counter()
        change = PolicyWords(miss_policy, admission, fill_reused, return_rule, late_fill,
                             host_rates)
        policy_asked = change.given
        if self.cache is None or self.backend == "cpu" or not self.cache.num_slots:
            raise ValueError("--freetoken-backend cpu runs every routed expert on the CPU: it "
                             "has no GPU expert cache to resize" +
                             (" and no miss policy" if policy_asked else ""))
        if policy_asked and slots is None and gb is None:
            slots = self.cache.num_slots  # the policy alone: rebuilt at the same size
            reason = "policy" if reason == "request" else reason
        if (slots is None) == (gb is None):
            raise ValueError('give exactly one of "slots" and "gb"')
        per = self.pool.expert_bytes
        rows = self.pool.num_rows
        want = int(slots) if slots is not None else int(min(float(gb) * GIB / per, rows + 1))
        new_slots = min(want, rows)
        if new_slots < self.top_k:
            raise ValueError(
                f"{want} slots cannot serve one token's top-{self.top_k} experts; ask for at "
                f"least {self.top_k} slots ({self.top_k * per / 2**20:.2f} MiB)"
            )
        old = self.cache
        clamped = want > new_slots
        if self.device.type == "cuda":
            from freetoken_sglang.cache.resize import resize_allowance

            torch.cuda.synchronize(self.device)
            free = self._free_for_cache()
            reserve = self.runtime_reserve_bytes
            allowed = resize_allowance(old.nbytes, free, reserve)
            if new_slots * per > allowed:
                raise ValueError(
                    f"{new_slots} slots need {new_slots * per / GIB:.2f} GiB but the cache can "
                    f"have {allowed / GIB:.2f} GiB: its own {old.nbytes / GIB:.2f} GiB and the "
                    f"{max(0, free - reserve) / GIB:.2f} GiB free beyond the "
                    f"{reserve / GIB:.2f} GiB SGLang's runtime keeps; ask for fewer slots"
                )
        # after the size checks: a q* change may measure B_P and B_H (seconds) first
        new_policy = self._policy_for(change) if policy_asked else None
        layout = self._plan_layout(new_slots)
        old_layout, old_slots = old.layout, old.num_slots
        # most recently used first
        everything = kept_experts(old.residency, old.residency.num_slots, self.num_experts)
        filled = kept_fill_clocks(old.residency, everything)
        clock = int(old.residency.clock.item())
        last_use = old.residency.last_use.clone()
        saved = self._serving_state()
        old_policy = self.policy
        if new_policy is not None:
            self._set_policy(new_policy)
        from freetoken_sglang.observe.document import prefill_stream_counts

        self.stream_carry = prefill_stream_counts(self)  # counts of the executors dropped now
        graphs = self._captured_graphs()
        old = None
        self._drop_cache(graphs)  # the old banks go first: the kept experts come from the pool
        try:
            recaptured = self._build_cache(layout, everything, clock, last_use, graphs,
                                           filled)
        except Exception as e:  # noqa: BLE001 - out of memory, a capture failure: roll back
            logger.error("FreeToken: resizing the cache to %d slots failed (%s: %s); "
                         "rebuilding it at %d slots", new_slots, type(e).__name__, e, old_slots)
            self._drop_cache(graphs)
            self._set_policy(old_policy)
            self._build_cache(old_layout, everything, clock, last_use, graphs, filled)
            self._restore_serving_state(saved)
            raise ValueError(
                f"the resize to {new_slots} slots failed ({type(e).__name__}: {e}); the cache "
                f"was rebuilt at its old size of {old_slots} slots and policy "
                f"{old_policy.label}"
            ) from e
        self._restore_serving_state(saved)
        if self.replay is not None and reason in ("request", "policy"):
            self.replay.rewind()  # each size and policy asked for replays the trace from row 0
        if reason == "request":  # the size --freetoken-min-free-gb grows back to
            self.configured_slots = new_slots
        if self.device.type == "cuda" and self.cache.nbytes < old_slots * per:
            from freetoken_sglang.cache.resize import shrink_floor

            floor = shrink_floor(free, self._free_for_cache(), old_slots * per - self.cache.nbytes)
            if self.shrink_floor_bytes is None or floor < self.shrink_floor_bytes:
                self.shrink_floor_bytes = floor
        self.resizes += 1
        resident = len(everything)
        kept = resident if self.cache.all_resident else min(resident, layout.lru_slots)
        report = ResizeReport(
            old_slots=old_slots,
            new_slots=self.cache.num_slots,
            old_bytes=old_slots * per,
            new_bytes=self.cache.nbytes,
            kept=kept,
            dropped=resident - kept,
            layout=layout.describe(self.num_experts),
            graphs_recaptured=tuple(recaptured),
            seconds=time.perf_counter() - t0,
            reason=reason,
            free_bytes_after=torch.cuda.mem_get_info(self.device)[0]
            if self.device.type == "cuda" else None,
            clamped_to_pool=clamped,
            invariant_problems=tuple(check_invariants(self.cache.residency)),
            miss_policy=self.policy.label,
        )
        logger.info(
            "FreeToken: GPU expert cache resized (%s) from %d to %d slots (%.2f -> %.2f GiB) "
            "in %.2f s: kept %d experts, dropped %d; %s%s%s", reason, report.old_slots,
            report.new_slots, report.old_bytes / GIB, report.new_bytes / GIB, report.seconds,
            report.kept, report.dropped, report.layout,
            f"; CUDA graphs captured again: {', '.join(recaptured)}" if recaptured else "",
            f" ({want} slots asked for: clamped to the pool)" if clamped else "",
        )
        if self.policy != old_policy:
            logger.info("FreeToken: decode misses now %s (was %s): %s", self.policy.label,
                        old_policy.label, self.describe_policy())
        return report

    def _policy_for(self, change: PolicyWords) -> MissPolicy:
        """The miss policy a resize asks for (``resize_cache``), ``change.over`` the current
        one. A change to ``qstar`` on a server without B_P and B_H measures them now
        (``policy.rates.resolve``: the profile cache, else a measurement of a few seconds).

        Raises:
            ValueError: a policy that runs misses on the CPU on a server started without the
                CPU branch (``fill``), rules without ``qstar`` or rules that exclude each
                other (``MissPolicy``), a failed bandwidth measurement, or the host rates
                beside each other where ``--freetoken-bandwidth`` leaves them out
                (``Bandwidth.split_rates``).
        """
        words = change.over(self.policy)
        name = words.miss_policy
        if name != "fill" and self.cpu_branch is None:
            raise ValueError(
                f"the {name} miss policy runs misses on the CPU, and this server started "
                "without the CPU branch (--freetoken-miss-policy fill): start it with "
                "--freetoken-miss-policy qstar or cpu to change policies while serving")
        if name != "qstar":
            return words.policy()
        try:
            bw = self._resolve_bandwidth(beside=words.host_rates == "beside")
        except Exception as e:  # noqa: BLE001 - the server keeps serving its old policy
            given = "B_P,B_H,F_P,F_H,B_P',B_H'" if words.host_rates == "beside" else "B_P,B_H"
            raise ValueError(
                f"measuring B_P and B_H for qstar failed ({type(e).__name__}: {e}); start the "
                f"server with --freetoken-bandwidth {given} (python -m freetoken_sglang.profile "
                "measures them)") from e
        return words.policy(bw, self.pool.expert_bytes)

    def _set_policy(self, policy: MissPolicy) -> None:
        """Serve decode misses by ``policy`` from the next captured or eager forward (the
        decode executor reads it per call); on CUDA its q table is built before a capture."""
        self.policy = policy
        if self.device.type == "cuda":
            from freetoken_sglang.kernels.residency import q_table

            q_table(policy.decode_split, self.num_experts, self.device)
            q_table(policy.split_for(1, decode=False), self.num_experts, self.device)

    def _captured_graphs(self) -> tuple:
        """The phases whose CUDA graphs SGLang captured (``decode``, ``prefill``): runners
        other than the eager one a disabled phase runs (``ModelRunner.eager_runner``)."""
        mr = self.model_runner
        eager = getattr(mr, "eager_runner", None)
        return tuple(p for p in ("decode", "prefill")
                     if getattr(mr, f"{p}_cuda_graph_runner", None) not in (None, eager))

    def _drop_cache(self, graphs: tuple) -> None:
        """Release the slot banks: the cache, its executors, and the captured graph runners
        that reference them (a breakable prefill graph keeps the streamed executor's eager
        function alive); the memory goes back to the device."""
        for phase in graphs:
            setattr(self.model_runner, f"{phase}_cuda_graph_runner", None)
        self.executors, self.cache = {}, None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _build_cache(self, layout: SlotLayout, everything, clock: int, last_use,
                     graphs: tuple, filled=None) -> list:
        """A cache of ``layout`` with its executors and CUDA graphs, holding the most recent
        of ``everything`` (``cache.resize.kept_experts``' pairs) that fit its LRU, with their
        last fill clocks (``filled``, ``cache.resize.kept_fill_clocks``)."""
        from freetoken_sglang.cache.resize import install

        self.cache = self._new_cache(layout)
        self._start_executors()
        if self.anchors is not None:
            self.anchors.follow_experts(self.experts_on_gpu)
        recaptured = self._recapture_graphs(graphs)
        if not self.cache.all_resident:
            install(self.cache.residency, self.cache.filler, everything[: layout.lru_slots],
                    clock, filled)
        self.cache.residency.last_use.copy_(last_use)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # what the capture allocated and freed
        return recaptured

    def _serving_state(self) -> tuple:
        """What a graph capture's dummy batches (and a new cache) would disturb: counters,
        late fills, forwards seen and the routing replay's position."""
        replay = (self.replay.cursor.clone(), self.replay.rows_used) if self.replay else None
        late = self.cache.residency.late.clone() if self.cache is not None else None
        return self.counters.counts.clone(), dict(self.forwards), replay, late

    def _restore_serving_state(self, saved: tuple) -> None:
        counts, forwards, replay, late = saved
        self.counters.counts.copy_(counts)
        if late is not None and self.cache is not None:
            self.cache.residency.late.copy_(late)
        self.forwards = forwards
        if replay is not None:
            self.replay.cursor.copy_(replay[0])
            self.replay.rows_used = replay[1]

    def _recapture_graphs(self, graphs: tuple) -> list:
        """Capture SGLang's CUDA graphs of ``graphs`` again over the new slot banks
        (``ModelRunner.init_decode_cuda_graph`` / ``init_prefill_cuda_graph``, public methods
        of SGLang 0.5.17); the capture hook then empties the cache."""
        mr = self.model_runner
        if "decode" in graphs:
            mr.init_decode_cuda_graph()
        if "prefill" in graphs:
            mr.init_prefill_cuda_graph()
        return list(graphs)

    @property
    def experts_on_gpu(self) -> bool:
        """Whether every routed expert is resident on the GPU (the ``resident`` layout of the
        GPU backend; set once the model loaded, ``finish_load``)."""
        return self.choice.backend == "gpu" and self.choice.layout_kind == RESIDENT

    def note_serving_start(self) -> None:
        """Record the device's free memory once SGLang has allocated its KV pool and captured
        its CUDA graphs (``Scheduler.__init__`` returned): what the runtime works with."""
        if self.device.type == "cuda" and self.serving_free_bytes is None:
            self.serving_free_bytes = self._free_for_cache()

    def _free_for_cache(self) -> int:
        """Bytes a rebuilt cache can take besides the old one's: free on the device once
        torch's allocator has given back the blocks it holds unused (``_drop_cache`` does the
        same before the rebuild), so activations cached since start-up do not count as used."""
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(self.device)[0])

    @property
    def runtime_reserve_bytes(self) -> int:
        """Device memory a resize leaves free for SGLang's runtime (bytes;
        ``cache.resize.runtime_reserve``)."""
        from freetoken_sglang.cache.resize import runtime_reserve

        return runtime_reserve(self.slack_bytes, self.serving_free_bytes,
                               self.shrink_floor_bytes)

    def watch_free_memory(self, now: Optional[float] = None) -> Optional["ResizeReport"]:
        """``--freetoken-min-free-gb``: at most once a second (at a scheduler safe point),
        shrink the cache when free device memory is under the floor and grow it back towards
        the configured size (or the last requested one) when there is room again
        (``cache.resize.min_free_target``); after a failed resize, wait 30 s."""
        g = self.config.min_free_gb
        if g is None or self.device.type != "cuda" or self.cache is None:
            return None
        now = time.monotonic() if now is None else now
        if now < self._next_watch:
            return None
        self._next_watch = now + 1.0
        from freetoken_sglang.cache.resize import min_free_target

        def target_for(free_bytes):
            return min_free_target(
                self.cache.num_slots, self.configured_slots, self.top_k, free_bytes,
                int(g * GIB) + self.runtime_reserve_bytes, self.pool.expert_bytes,
                grow_step=max(self.top_k, self.configured_slots // 20),
            )

        # The cheap reading leaves out blocks torch's allocator holds unused; before acting,
        # measure as the reserve was measured (after ``empty_cache``).
        target = target_for(torch.cuda.mem_get_info(self.device)[0])
        if target is not None:
            free = self._free_for_cache()
            target = target_for(free)
        if target is None:
            return None
        logger.info(
            "FreeToken: %.2f GiB of GPU memory free against --freetoken-min-free-gb %.2f: "
            "resizing the expert cache from %d to %d slots", free / GIB, g,
            self.cache.num_slots, target,
        )
        try:
            report = self.resize_cache(slots=target, reason="min-free")
        except ValueError as e:
            logger.warning("FreeToken: the min-free resize was not done (next try in 30 s): "
                           "%s", e)
            self._next_watch = now + 30.0
            self.last_resize = {"id": None, "ok": False, "reason": "min-free", "error": str(e)}
            return None
        self.last_resize = {"id": None, "ok": True, **report.as_dict()}
        return report

    def stats(self) -> Dict[str, object]:
        """The ``/freetoken/stats`` document (``observe/document.py``)."""
        from freetoken_sglang.observe.document import stats_document

        return stats_document(self)


def start(config: FreeTokenConfig, model_runner) -> FreeTokenRuntime:
    """Create this process's runtime for ``model_runner`` (replacing any earlier one)."""
    global _RUNTIME
    _RUNTIME = FreeTokenRuntime(config, model_runner)
    return _RUNTIME


