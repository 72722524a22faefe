"""FreeToken's server flags: their argparse surface, validation and the ServerArgs they imply.

Every flag is both a ``launch_server`` flag (``--freetoken-cache-ratio 0.25``) and an
``sglang.Engine`` keyword (``freetoken_cache_ratio=0.25``), as SGLang's own flags are. The
parsed values travel to the scheduler processes as one ``FreeTokenConfig`` attribute of
``ServerArgs`` (``server_args.freetoken``), which pickles with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from freetoken_sglang.errors import RefusedError

logger = logging.getLogger(__name__)

# ServerArgs attribute that carries the config to every process (None: FreeToken is off).
SERVER_ARGS_ATTR = "freetoken"

DEFAULT_KV_RESERVE_GB = 2.0


def _number(kind, minimum, inclusive: bool, what: str, bound: str):
    """An argparse type: ``kind(text)`` at or above (or above) ``minimum``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if not (value > minimum or (inclusive and value == minimum)):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


_positive_float = _number(float, 0.0, False, "a number", "greater than 0")
_non_negative_float = _number(float, 0.0, True, "a number", "0 or more")
_positive_int = _number(int, 1, True, "a whole number", "at least 1")


def _bandwidth(text: str):
    from freetoken_sglang.policy.rates import parse_flag

    try:
        return parse_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _ftw_dir(text: str) -> str:
    """An argparse type: an existing directory (its manifest is checked at start)."""
    import os

    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a directory; write one with python -m freetoken_sglang.convert "
            "--model-path M --out DIR"
        )
    return text


def _prefill_cpu(text: str) -> str:
    """An argparse type: ``off``, ``auto`` or a fraction in [0, 1] (kept as its text)."""
    if text in ("off", "auto"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: give off, auto or a fraction above 0 up to 1 (e.g. 0.4)"
        )
    return text


_prefill_cpu.metavar = "{off,auto,F}"


# The words of each miss-policy rule's flag (``--freetoken-admission`` ...), the first its
# default; ``policy.words.PolicyWords`` and ``POST /freetoken/cache`` (``control.py``) read them.
RULE_WORDS = {
    "admission": ("off", "reuse", "useful"),
    "fill_reused": ("off", "on", "valued"),
    "return_rule": ("off", "on"),
    "late_fill": ("off", "on", "all"),
    "host_rates": ("alone", "beside"),
}


def _choice(*options):
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(
                f"invalid choice {text!r} (choose from {', '.join(options)})"
            )
        return text

    parse.metavar = "{" + ",".join(options) + "}"  # what --help shows
    return parse


#: The C executor's kernel paths the flag names (``cpu.executor.ISAS`` less its test path).
_CPU_ISAS = ("portable", "avx2", "avx512", "avx512_bf16", "amx")


def _choice_int(*options):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value not in options:
            raise argparse.ArgumentTypeError(
                f"invalid choice {text!r} (choose from {', '.join(map(str, options))})"
            )
        return value

    parse.metavar = "{" + ",".join(map(str, options)) + "}"
    return parse


@dataclass
class FreeTokenConfig:
    """The parsed ``--freetoken-*`` flags.

    At most one of ``cache_gb``, ``cache_ratio`` and ``cache_slots`` is set; with none, the
    cache takes the GPU memory left after the non-expert weights, SGLang's runtime slack
    (``1 - mem_fraction_static``) and a KV pool of at least ``kv_reserve_gb``.
    """

    cache_gb: Optional[float] = field(
        default=None,
        metadata=dict(
            type=_positive_float,
            help="GPU expert cache size in GiB (rounded down to whole slots).",
        ),
    )
    cache_ratio: Optional[float] = field(
        default=None,
        metadata=dict(
            type=_positive_float,
            help="GPU expert cache size as a fraction of the host expert pool "
            "(0.25 = a quarter of all routed experts; 1 or more = every expert resident).",
        ),
    )
    cache_slots: Optional[int] = field(
        default=None,
        metadata=dict(
            type=_positive_int,
            help="GPU expert cache size in slots (one slot = one (layer, expert)).",
        ),
    )
    kv_reserve_gb: float = field(
        default=DEFAULT_KV_RESERVE_GB,
        metadata=dict(
            type=_non_negative_float,
            help="With no cache-size flag: GPU memory in GiB kept for the KV pool when the "
            f"cache is sized automatically (default {DEFAULT_KV_RESERVE_GB}).",
        ),
    )

    min_free_gb: Optional[float] = field(
        default=None,
        metadata=dict(
            type=_positive_float,
            help="Keep at least this much GPU memory (GiB) free for other applications, "
            "beyond what SGLang's runtime keeps: the expert cache shrinks by itself when free "
            "memory falls below it and grows back towards its configured size when memory is "
            "free again, with a margin against resizing back and forth (checked once a second; "
            "each resize is logged). Needs a CUDA device.",
        ),
    )

    miss_policy: str = field(
        default="fill",
        metadata=dict(
            type=_choice("qstar", "fill", "cpu"),
            help="How decode-step cache misses are served: fill (default) sends every miss "
            "over PCIe into the cache; qstar fills q* = round(m * B_P / B_H) of the m misses "
            "and runs the rest in place on the CPU at the same time; cpu runs every miss on "
            "the CPU.",
        ),
    )
    admission: str = field(
        default="off",
        metadata=dict(
            type=_choice(*RULE_WORDS["admission"]),
            help="With --freetoken-miss-policy qstar: reuse fills only misses whose last "
            "use is more recent than the least recently used slot's (an expert that would "
            "not have survived in the cache since its last use runs on the CPU instead and "
            "the cache keeps what it has, against thrash at small caches); useful does so "
            "only while the least recently used slot went unused since its last fill (the "
            "cache's fills are evicted unused: thrash) and admits every miss otherwise; off "
            "(default): every miss may be filled.",
        ),
    )
    fill_reused: str = field(
        default="off",
        metadata=dict(
            type=_choice(*RULE_WORDS["fill_reused"]),
            help="With --freetoken-miss-policy qstar: on fills every miss whose last use is "
            "more recent than the least recently used slot's (an expert the CPU served and "
            "routed to again within the cache's LRU age), counted in the call's q* fills "
            "(all of them where they outnumber q*), the other misses filling what is left "
            "(with --freetoken-admission: only those it admits; with useful, the reused "
            "misses are filled only while it admits every miss); valued: as on, but only "
            "the reused misses expected to be used again at least B_H/B_P - 1 times before "
            "eviction (the LRU age over the time since their last use), which is what a "
            "fill costs in CPU runs (the same as on where B_P/B_H >= 1/2); off (default): q* "
            "splits every miss, as in the paper.",
        ),
    )
    return_rule: str = field(
        default="off",
        metadata=dict(
            type=_choice(*RULE_WORDS["return_rule"]),
            help="With --freetoken-miss-policy qstar: on keeps a call's CPU experts on the "
            "CPU only where the time they save now exceeds the later fills of those that "
            "return (r, the measured share of misses used again within the cache's LRU age); "
            "otherwise every miss is filled. off (default): Eq. 4 and the lone-miss rule.",
        ),
    )
    late_fill: str = field(
        default="off",
        metadata=dict(
            type=_choice(*RULE_WORDS["late_fill"]),
            help="With --freetoken-miss-policy qstar: on runs the misses of a layer call that "
            "q* fills none of (with B_P/B_H near 1/3: a lone miss) on the CPU and fills them "
            "after the call, beside the GPU's work on the next layers, so the call does not "
            "wait for the fill and the expert is resident for its next use; q* then drops "
            "the paper's at-least-one fill; all also fills every other CPU run late (those "
            "--freetoken-admission admits, where it is on). off (default): Eq. 4 as "
            "in the paper.",
        ),
    )
    cpu_branch: str = field(
        default="doorbell",
        metadata=dict(
            type=_choice("doorbell", "host-node"),
            help="How the GPU hands a decode layer call's CPU experts to the C executor (qstar "
            "and cpu on a GPU; the prefill CPU share always uses host-function nodes): doorbell "
            "(default) writes them into mapped host memory for a polling thread, from the decision "
            "kernel, and the MoE's sum awaits their partial, so a call without CPU experts "
            "launches no extra kernel (a MoE not ending in SGLang's general sum, e.g. top-2 at "
            "scale 1: one merge kernel that returns at once); host-node runs a CUDA host-function node on every layer "
            "call.",
        ),
    )
    fp4_kernels: str = field(
        default="direct",
        metadata=dict(
            type=_choice("direct", "dequantized"),
            help="FP4 experts (MXFP4, NVFP4) in the GPU cache: direct (default) runs decode "
            "calls of at most 32 (token, expert) pairs with FreeToken's kernels that read the "
            "FP4 codes in their slots (3.7-7x faster per call than dequantizing; the output "
            "differs from SGLang's Triton MoE over the dequantized experts by fp32 summation "
            "order); dequantized runs every call through SGLang's Triton MoE over the slots "
            "dequantized to the activation dtype (its results bit for bit).",
        ),
    )
    bandwidth: Optional[tuple] = field(
        default=None,
        metadata=dict(
            type=_bandwidth,
            help="B_P,B_H in GB/s (pinned host-to-GPU fills, CPU executor), optionally "
            "followed by F_P,F_H, the fill and CPU branches' fixed costs in us (without them "
            "qstar has no lone-miss rule), then by B_P',B_H', the two rates in GB/s while both "
            "run (for --freetoken-host-rates beside), instead of the measured profile (python "
            "-m freetoken_sglang.profile).",
        ),
    )
    host_rates: str = field(
        default="alone",
        metadata=dict(
            type=_choice(*RULE_WORDS["host_rates"]),
            help="With --freetoken-miss-policy qstar, the rates its split reads: alone "
            "(default) B_P and B_H each measured alone, the CPU taking B_H - B_P beside a "
            "busy link as in the paper's Eq. 3 (q*/m = B_P/B_H); beside both measured while "
            "the other runs, B_P' and B_H' (q*/m = B_P'/(B_P' + B_H'); the lone-miss rule and "
            "the valued re-miss rule read the same two).",
        ),
    )
    backend: str = field(
        default="gpu",
        metadata=dict(
            type=_choice("gpu", "cpu"),
            help="gpu (default): the GPU expert cache; cpu: every routed expert runs on the CPU "
            "from pageable host memory, the rest of the model on the GPU (the way to serve "
            "when the pool cannot be pinned).",
        ),
    )
    cpu_threads: Optional[int] = field(
        default=None,
        metadata=dict(
            type=_positive_int,
            help="Threads of the CPU expert executor (default: one per physical core).",
        ),
    )
    cpu_isa: str = field(
        default="auto",
        metadata=dict(
            type=_choice("auto", *_CPU_ISAS),
            help="Kernel path of the CPU expert executor: auto (default) picks the best "
            "this CPU has among portable, avx2, avx512 and avx512_bf16; amx adds AMX-BF16 "
            "tiles for the experts of a call with at least 8 tokens (prefill CPU share, "
            "batches; BF16 experts with hidden and intermediate sizes multiples of 32; "
            "measured faster from 8 tokens per expert, not yet inside a server, so auto "
            "does not pick it).",
        ),
    )

    prefill: str = field(
        default="stream",
        metadata=dict(
            type=_choice("stream", "lru"),
            help="stream (default): prefill layer calls of at least --freetoken-stream-min-"
            "tokens rows stream whole layers over PCIe into full-layer buffers, overlapping "
            "compute, outside the decode LRU (see --freetoken-prefill-buffers); lru: prefill "
            "goes through the decode LRU like decode (fills and evictions).",
        ),
    )
    stream_min_tokens: Optional[int] = field(
        default=None,
        metadata=dict(
            type=_positive_int,
            help="Prefill layer calls of at least this many rows stream (default: the "
            "crossover rule, the rows at which a call is expected to route to 75%% of a "
            "layer's experts).",
        ),
    )
    stream_buffers: int = field(
        default=2,
        metadata=dict(
            type=_choice_int(1, 2),
            help="Full-layer prefill buffers: 2 (default) overlaps each layer's transfer "
            "with the previous layer's compute; 1 copies each layer after the previous one "
            "computed (no overlap; for comparison).",
        ),
    )

    prefill_cpu: str = field(
        default="off",
        metadata=dict(
            type=_prefill_cpu,
            help="Streamed prefill with a CPU share: auto runs the share of each streamed "
            "layer's non-resident experts that balances the C executor's time (measured, "
            "growing with the tokens per expert) against the PCIe time of the rest, on the "
            "CPU while the GPU computes the streamed experts; a fraction F runs that share; "
            "off (default): every non-resident expert streams.",
        ),
    )

    prefill_buffers: str = field(
        default="borrowed",
        metadata=dict(
            type=_choice("borrowed", "reserved"),
            help="borrowed (default): each streamed forward lends the LRU's least recently "
            "used slots out as the buffers and gives them back holding the last layers' "
            "experts; reserved: the buffers are kept outside the LRU for good (a prefill "
            "evicts nothing; decode has the buffers' slots fewer).",
        ),
    )

    anchors: Optional[str] = field(
        default=None,
        metadata=dict(
            type=_choice("on", "off"),
            help="Semantic anchors (hybrid models): the recurrent state at each thinking, "
            "tool-call, tool-output and turn marker is kept (see --freetoken-anchor-cuts for "
            "how), with its own budget, and a later turn edited after it restores from it. "
            "Default: on for hybrid models (it sets --mamba-radix-cache-strategy no_buffer); "
            "off turns it off.",
        ),
    )
    anchor_tokens: Optional[str] = field(
        default=None,
        metadata=dict(
            type=str,
            help="Comma-separated anchor markers instead of the default "
            "<think>,</think>,<tool_call>,</tool_call>,<tool_response>,</tool_response>,"
            "<|im_start|>,<|im_end|> (a marker may encode to several tokens).",
        ),
    )
    anchor_states: Optional[int] = field(
        default=None,
        metadata=dict(
            type=_positive_int,
            help="Anchor states kept at most, least recently used evicted first (default: "
            "half the mamba state pool left after two states per running request; logged).",
        ),
    )
    anchor_min_distance: int = field(
        default=32,
        metadata=dict(
            type=_positive_int,
            help="Anchors closer than this many tokens to the previous one are merged into "
            "it, and an anchor this close after the matched prefix or before the prompt end "
            "keeps that state instead of ending a chunk (default 32; 1: every marker).",
        ),
    )

    anchor_cuts: str = field(
        default="auto",
        metadata=dict(
            type=_choice("auto", "on", "inside", "off"),
            help="How anchors keep the exact state at each marker. on: a prefill chunk ends "
            "there (one more prefill forward per anchor; with streamed prefill one more pass "
            "over the host pool). inside: each recurrent layer takes the state at each anchor "
            "inside the forward (from its kernel's chunk-start states, or by replaying its "
            "inputs up to the anchor), and no chunk ends there. off: no state of their own; "
            "anchors pin the states SGLang keeps anyway (the matched prefix and the prompt "
            "end, each when a marker lies within --freetoken-anchor-min-distance). auto "
            "(default): on when every routed expert is on the GPU, else inside.",
        ),
    )

    record_routing: Optional[str] = field(
        default=None,
        metadata=dict(
            type=str,
            help="Write every forward step's phase and top-k expert ids per MoE layer to this "
            ".npz routing trace (freetoken_sglang/observe/routing_trace.py; replay it with "
            "benchmarks/replay.py). Off by default, and free when off.",
        ),
    )
    replay_routing: Optional[str] = field(
        default=None,
        metadata=dict(
            type=str,
            help="Benchmarks only: every MoE layer routes to this routing trace's top-k ids, "
            "row after row, instead of its router's (observe/routing_replay.py), so that "
            "dummy-weight runs see a recorded or trained model's routing; outputs are then "
            "not the model's. The trace's experts must be the model's, its top-k the model's or "
            "a larger one in rank order (its first ids are replayed). Off by default, and "
            "free when off.",
        ),
    )
    replay_phase: str = field(
        default="all",
        metadata=dict(
            type=_choice("all", "decode"),
            help="With --freetoken-replay-routing: replay all the trace's rows in order "
            "(default) or only its decode steps' rows.",
        ),
    )
    ftw: Optional[str] = field(
        default=None,
        metadata=dict(
            type=_ftw_dir,
            help="Load the host expert pool from this FTW directory (written by python -m "
            "freetoken_sglang.convert --model-path M --out DIR): the checkpoint's routed-expert "
            "tensors are skipped, and the banks are read with parallel direct I/O and "
            "checksummed; the other weights load from --model-path as usual. A directory "
            "that does not match the served model, or is corrupt, is refused at start.",
        ),
    )


    def anchors_enabled(self, hybrid: bool) -> bool:
        """Whether semantic anchors run for a model (``hybrid``: families.is_hybrid)."""
        return hybrid and self.anchors != "off"

    def anchor_marker_list(self):
        """The anchor marker strings in use (``--freetoken-anchor-tokens`` or the default)."""
        from freetoken_sglang.anchors.markers import DEFAULT_MARKERS, parse_markers

        return (parse_markers(self.anchor_tokens) if self.anchor_tokens is not None
                else DEFAULT_MARKERS)


def cli_name(field_name: str) -> str:
    return "--freetoken-" + field_name.replace("_", "-")


def kwarg_name(field_name: str) -> str:
    return "freetoken_" + field_name


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--enable-freetoken`` and every ``--freetoken-*`` flag to SGLang's parser."""
    group = parser.add_argument_group(
        "FreeToken",
        "Serve MoE models with routed experts in host memory and a GPU expert cache "
        "(freetoken-sglang).",
    )
    group.add_argument(
        "--enable-freetoken",
        action="store_true",
        default=False,
        help="Keep every routed expert in host memory and serve it through a GPU expert "
        "cache shared by all MoE layers.",
    )
    size = group.add_mutually_exclusive_group()
    for f in dataclasses.fields(FreeTokenConfig):
        target = size if f.name.startswith("cache_") else group
        target.add_argument(
            cli_name(f.name),
            dest=kwarg_name(f.name),
            type=f.metadata["type"],
            default=f.default,
            help=f.metadata["help"],
            metavar=getattr(f.metadata["type"], "metavar", f.name.upper()),
        )


def _validated(name: str, value: Any) -> Any:
    """Check an Engine keyword value the way argparse checks the CLI flag."""
    f = {f.name: f for f in dataclasses.fields(FreeTokenConfig)}[name]
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        value = ",".join(str(v) for v in value)
    try:
        return f.metadata["type"](str(value))
    except argparse.ArgumentTypeError as e:
        raise RefusedError(f"{kwarg_name(name)}={value!r}: {e}") from None


def pop_config(kwargs: Dict[str, Any]) -> Optional[FreeTokenConfig]:
    """Remove ``enable_freetoken`` and ``freetoken_*`` keys from ServerArgs keyword
    arguments and return the config they describe (None when FreeToken is off).

    Raises:
        ValueError: an unknown ``freetoken_*`` keyword, a bad value, two cache-size
            keywords, or ``freetoken_*`` keywords without ``enable_freetoken=True``.
    """
    enable = bool(kwargs.pop("enable_freetoken", False))
    names = {kwarg_name(f.name): f.name for f in dataclasses.fields(FreeTokenConfig)}
    given = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith("freetoken_")}
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise RefusedError(
            f"unknown FreeToken option(s) {unknown}; known: {sorted(names)}"
        )
    values = {names[k]: _validated(names[k], v) for k, v in given.items()}
    defaults = {f.name: f.default for f in dataclasses.fields(FreeTokenConfig)}
    non_default = {k for k, v in values.items() if v != defaults[k]}
    if not enable:
        if non_default:
            raise RefusedError(
                f"{sorted(kwarg_name(k) for k in non_default)} given without "
                "enable_freetoken=True (--enable-freetoken); add it or drop them"
            )
        return None
    sizes = [k for k in ("cache_gb", "cache_ratio", "cache_slots") if values.get(k)]
    if len(sizes) > 1:
        raise RefusedError(
            f"give at most one cache size, got {[kwarg_name(k) for k in sizes]}"
        )
    cfg = FreeTokenConfig(**values)
    check_combination(cfg, non_default)
    if cfg.cpu_isa != "auto":
        problem = cpu_isa_problem(cfg.cpu_isa)
        if problem:
            raise RefusedError(problem)
    return cfg


def cpu_isa_problem(isa: str) -> Optional[str]:
    """Why ``--freetoken-cpu-isa isa`` cannot run here (the C executor's own check of the CPU,
    the kernel's AMX permission and the build), or None."""
    from freetoken_sglang.cpu.executor import CpuExpertExecutor

    have = CpuExpertExecutor.available_isas()
    if isa in have:
        return None
    choices = [c for c in _CPU_ISAS if c in have]
    return (f"--freetoken-cpu-isa {isa}: this CPU, its kernel or this build lacks that kernel "
            f"path (here: {', '.join(choices)}); drop the flag (auto picks "
            f"{CpuExpertExecutor.best_isa()})")


def check_combination(cfg: FreeTokenConfig, given) -> None:
    """Refuse flags that the other flags would make ineffective (nothing is silently ignored).

    Raises:
        ValueError: naming the flag to drop or the one to add.
    """
    sizes = [k for k in ("cache_gb", "cache_ratio", "cache_slots") if getattr(cfg, k)]
    problems = []
    if cfg.backend == "cpu":
        ineffective = sizes + (["bandwidth"] if cfg.bandwidth is not None else [])
        ineffective += ["miss_policy"] if "miss_policy" in given else []
        ineffective += ["min_free_gb"] if cfg.min_free_gb is not None else []
        ineffective += ["admission"] if cfg.admission != "off" else []
        ineffective += ["fill_reused"] if "fill_reused" in given else []
        ineffective += ["host_rates"] if "host_rates" in given else []
        ineffective += ["return_rule"] if "return_rule" in given else []
        ineffective += ["late_fill"] if "late_fill" in given else []
        ineffective += ["cpu_branch"] if "cpu_branch" in given else []
        ineffective += ["prefill_cpu"] if "prefill_cpu" in given else []
        ineffective += ["fp4_kernels"] if "fp4_kernels" in given else []
        for name in ineffective:
            problems.append(f"{cli_name(name)} has no effect with --freetoken-backend cpu")
    else:
        if cfg.bandwidth is not None and cfg.miss_policy == "fill" and cfg.prefill_cpu != "auto":
            problems.append("--freetoken-bandwidth is used only by --freetoken-miss-policy qstar "
                            "(and by cpu, for a change to qstar while serving) and "
                            "--freetoken-prefill-cpu auto")
        if "cpu_branch" in given and cfg.miss_policy == "fill":
            problems.append("--freetoken-cpu-branch is used only by the qstar and cpu miss "
                            "policies (fill runs no decode miss on the CPU; the prefill CPU "
                            "share always uses host-function nodes)")
        if cfg.admission != "off" and cfg.miss_policy != "qstar":
            problems.append(
                "--freetoken-admission is used only by --freetoken-miss-policy qstar (fill "
                "sends every miss to the cache, cpu never fills)"
            )
        if cfg.return_rule == "on" and cfg.bandwidth is not None and len(cfg.bandwidth) == 2:
            problems.append("--freetoken-return-rule on needs the branches' fixed costs: give "
                            "--freetoken-bandwidth B_P,B_H,F_P,F_H, or no --freetoken-bandwidth "
                            "(FreeToken measures them)")
        if (cfg.host_rates == "beside" and cfg.bandwidth is not None
                and len(cfg.bandwidth) != 6):
            problems.append("--freetoken-host-rates beside needs the rates beside each other: "
                            "give --freetoken-bandwidth B_P,B_H,F_P,F_H,B_P',B_H', or no "
                            "--freetoken-bandwidth (FreeToken measures them)")
        for name in ("return_rule", "fill_reused", "host_rates"):
            if name in given and cfg.miss_policy != "qstar":
                problems.append(f"{cli_name(name)} is used only by --freetoken-miss-policy qstar")
        if cfg.miss_policy == "qstar" and cfg.return_rule == "on" and cfg.admission != "off":
            problems.append("--freetoken-return-rule on would fill the misses "
                            "--freetoken-admission sends to the CPU on purpose: give one of them")
        if "late_fill" in given and cfg.miss_policy != "qstar":
            problems.append("--freetoken-late-fill is used only by --freetoken-miss-policy qstar")
        elif cfg.late_fill != "off" and cfg.return_rule == "on":
            problems.append(f"--freetoken-late-fill {cfg.late_fill} removes the later fills "
                            "--freetoken-return-rule on weighs: give one of them")
        for name in ("cpu_threads", "cpu_isa"):
            if name in given and cfg.miss_policy == "fill" and cfg.prefill_cpu == "off":
                problems.append(
                    f"{cli_name(name)} is used only when misses run on the CPU "
                    "(--freetoken-miss-policy qstar or cpu, --freetoken-prefill-cpu, or "
                    "--freetoken-backend cpu)"
                )
        if cfg.prefill == "lru":
            for name in ("stream_min_tokens", "stream_buffers", "prefill_buffers", "prefill_cpu"):
                if name in given:
                    problems.append(
                        f"{cli_name(name)} has no effect with --freetoken-prefill lru"
                    )
        if sizes and "kv_reserve_gb" in given:
            problems.append(
                "--freetoken-kv-reserve-gb applies only without a cache-size flag"
            )
    if cfg.replay_routing is None and "replay_phase" in given:
        problems.append("--freetoken-replay-phase is used only with --freetoken-replay-routing")
    if cfg.anchors == "off":
        for name in ANCHOR_FLAGS:
            if name in given:
                problems.append(f"{cli_name(name)} has no effect with --freetoken-anchors off")
    if cfg.anchor_tokens is not None:
        from freetoken_sglang.anchors.markers import parse_markers

        try:
            parse_markers(cfg.anchor_tokens)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise RefusedError("; ".join(problems))


def _choose_chunk(kwargs: Dict[str, Any], cfg: Optional[FreeTokenConfig]) -> None:
    """Set ``chunked_prefill_size`` when the user gave none and prefill streams on a GPU
    (``execute.choice.choose_chunked_prefill_size``); logged. The GPU memory comes from
    SGLang's own ``get_device_memory_capacity`` (what its ``ServerArgs`` sizes with); without
    a GPU it is None and SGLang's default stands."""
    if kwargs.get("chunked_prefill_size") is not None or kwargs.get("device") == "cpu":
        return
    if cfg is not None and (cfg.prefill != "stream" or cfg.backend != "gpu"):
        return
    from sglang.srt.utils.common import get_device_memory_capacity

    from freetoken_sglang.execute.choice import choose_chunked_prefill_size

    gpu_mem = get_device_memory_capacity(kwargs.get("device") or "cuda")
    if not gpu_mem:
        return
    context = int(kwargs.get("context_length") or 0)
    chunk = choose_chunked_prefill_size(gpu_mem, context)
    logger.info(
        "FreeToken: --chunked-prefill-size %d (not given: the largest power of two whose "
        "activations SGLang reserves within a quarter of the %.0f GiB GPU; each streamed "
        "chunk costs one pass of the expert pool over PCIe, so fewer chunks, fewer passes)",
        chunk,
        gpu_mem / 1024,
    )
    kwargs["chunked_prefill_size"] = chunk


def _is_hybrid_checkpoint(kwargs: Dict[str, Any]) -> Optional[bool]:
    """Whether ``model_path`` is a hybrid family (None: its config cannot be read here)."""
    from freetoken_sglang import families

    path = kwargs.get("model_path")
    if not path:
        return None
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(
            path, trust_remote_code=bool(kwargs.get("trust_remote_code")),
            revision=kwargs.get("revision"),
        )
        return families.is_hybrid(hf_config)
    except Exception:
        return None  # unreadable or unsupported: the later checks name it


# The flags that tune semantic anchors (each needs anchors to be on).
ANCHOR_FLAGS = ("anchor_tokens", "anchor_states", "anchor_min_distance", "anchor_cuts")


def _anchor_overrides(kwargs: Dict[str, Any], cfg: FreeTokenConfig) -> None:
    """The ServerArgs semantic anchors need: SGLang's ``no_buffer`` hybrid cache strategy,
    which keeps a recurrent state at every prefill chunk end (``extra_buffer`` keeps states
    on a 64-token grid only), with the overlap schedule off as that strategy requires.

    Raises:
        ValueError: anchors on a non-hybrid model, or with settings they cannot run under.
    """
    hybrid = _is_hybrid_checkpoint(kwargs)
    if not hybrid:
        defaults = FreeTokenConfig()
        tuned = [n for n in ("anchors",) + ANCHOR_FLAGS
                 if n != "anchors" or cfg.anchors == "on"
                 if getattr(cfg, n) != getattr(defaults, n)]
        if tuned and hybrid is False:
            raise RefusedError(
                f"{', '.join(cli_name(n) for n in tuned)} applies to hybrid models "
                "(Qwen3-Next, Qwen3.5-MoE) only: drop it"
            )
        return
    if cfg.anchors == "off":
        return
    problems = []
    if kwargs.get("disable_radix_cache"):
        problems.append("they need the radix cache: drop --disable-radix-cache")
    cuts = cfg.anchor_cuts in ("on", "auto")  # auto is resolved at scheduler start
    if cuts and kwargs.get("chunked_prefill_size") == -1:
        problems.append("they end prefill chunks: drop --chunked-prefill-size -1, or pass "
                        "--freetoken-anchor-cuts inside")
    if cuts and kwargs.get("enable_deterministic_inference"):
        problems.append("deterministic inference aligns chunks to 4096 tokens: drop "
                        "--enable-deterministic-inference, or pass --freetoken-anchor-cuts inside")
    if kwargs.get("enable_hierarchical_cache"):
        problems.append("they are not built for HiCache: drop --enable-hierarchical-cache")
    strategy = kwargs.get("mamba_radix_cache_strategy") or "auto"
    if strategy not in ("auto", "no_buffer"):
        problems.append(
            f"they need --mamba-radix-cache-strategy no_buffer (a state at each chunk end), "
            f"not {strategy}"
        )
    if problems:
        raise RefusedError(
            "--enable-freetoken: semantic anchors (on by default for hybrid models): "
            + "; ".join(problems) + "; or pass --freetoken-anchors off"
        )
    if strategy == "auto":
        logger.info(
            "FreeToken: semantic anchors set --mamba-radix-cache-strategy no_buffer and "
            "--disable-overlap-schedule (a recurrent state at each prefill chunk end)"
        )
        kwargs["mamba_radix_cache_strategy"] = "no_buffer"
        kwargs["disable_overlap_schedule"] = True


def apply_server_args_overrides(
    kwargs: Dict[str, Any], cfg: Optional[FreeTokenConfig] = None
) -> Dict[str, Any]:
    """ServerArgs keyword changes the FreeToken mode needs, applied before SGLang's own
    ``__post_init__`` sees them; each change is logged.

    Raises:
        RefusedError: a ServerArgs value FreeToken cannot serve with (or a local-looking
            ``--model-path`` that does not exist), naming the fix.
    """
    problems = []
    path = kwargs.get("model_path")
    if isinstance(path, str) and path.startswith(("/", "./", "../")) and not os.path.exists(path):
        # (stock SGLang would pass it to the Hugging Face hub as a repo id and fail there)
        problems.append(f"--model-path {path} does not exist: pass a model folder that "
                        "exists (with its config.json) or a Hugging Face repo id")
    for name in ("tp_size", "pp_size", "dp_size", "ep_size"):
        if (kwargs.get(name) or 1) != 1:
            problems.append(f"--{name.replace('_', '-')} must be 1 (one GPU)")
    if kwargs.get("quantization"):
        from freetoken_sglang.experts.formats import QUANTIZATIONS

        # "modelopt": SGLang resolves it from the checkpoint; the MoE layer checks what it is
        if kwargs["quantization"] not in QUANTIZATIONS | {"modelopt"}:
            problems.append(
                f"--quantization {kwargs['quantization']} is not served yet: FreeToken "
                f"serves BF16, FP16 and FP32 experts and checkpoints quantized as "
                f"{', '.join(sorted(QUANTIZATIONS))} (FP8 with block scales, MXFP4, ModelOpt "
                "NVFP4); omit --quantization to serve the checkpoint's own"
            )
    if kwargs.get("cpu_offload_gb"):
        problems.append("--cpu-offload-gb is not supported (the host pool already keeps the "
                        "routed experts in host memory): drop it")
    if kwargs.get("enable_eplb"):
        problems.append("--enable-eplb is not supported")
    if kwargs.get("speculative_algorithm"):
        problems.append("speculative decoding is not supported yet")
    backend = kwargs.get("moe_runner_backend") or "auto"
    if backend not in ("auto", "triton"):
        problems.append(
            f"--moe-runner-backend {backend} is not supported: use auto or triton"
        )
    if (kwargs.get("moe_a2a_backend") or "none") != "none":
        problems.append("--moe-a2a-backend is not supported")
    for flag in (
        "enable_lora",
        "enable_dp_attention",
        "enable_two_batch_overlap",
        "enable_single_batch_overlap",
        "enable_torch_compile",
        # decode and split prefill at once on two streams: both would use the LRU state
        "enable_pdmux",
    ):
        if kwargs.get(flag):
            problems.append(f"--{flag.replace('_', '-')} is not supported")
    prefill_graph = kwargs.get("cuda_graph_backend_prefill")
    streams = cfg is None or (cfg.prefill == "stream" and cfg.backend == "gpu")
    if streams and prefill_graph not in (None, "breakable", "disabled"):
        problems.append(
            f"--cuda-graph-backend-prefill {prefill_graph} cannot run the streamed prefill "
            "(it needs the breakable backend's eager breaks): use breakable (the default), "
            "--disable-prefill-cuda-graph or --freetoken-prefill lru"
        )
    if (kwargs.get("disaggregation_mode") or "null") != "null":
        problems.append("prefill/decode disaggregation is not supported")
    if problems:
        raise RefusedError("--enable-freetoken: " + "; ".join(problems))
    _choose_chunk(kwargs, cfg)
    if cfg is not None:
        _anchor_overrides(kwargs, cfg)
    if not kwargs.get("disable_shared_experts_fusion"):
        logger.info(
            "FreeToken: setting disable_shared_experts_fusion=True so that shared "
            "experts stay ordinary GPU-resident modules, outside the routed set"
        )
        kwargs["disable_shared_experts_fusion"] = True
    return kwargs
