"""Synthetic MoE routing traces (Zipf expert popularity + decode temporal reuse) for replay
tests and plots; every trace it makes is marked ``synthetic: true``.

Model of the routing, one sequence at a time (batch 1, the single-user edge setting):

* Popularity. Layer ``l`` has a base popularity ranking, a random permutation of its E
  experts; the expert of rank ``r`` (1-based) has weight ``r ** -zipf``.
* Sessions. Each session (an agent conversation) perturbs every layer's ranking: a random
  ``drift`` fraction of the rank positions is shuffled among itself, so sessions share most
  of their hot experts but not all.
* Turns. A session has ``turns`` turns; a turn is a prefill of ``prefill_len`` tokens
  (uniform in the given range, split into steps of ``prefill_chunk`` tokens when > 0) then
  ``decode_len`` decode steps of one token each.
* Prefill tokens draw their k distinct experts per layer from the session popularity
  (sampling without replacement, Gumbel top-k).
* Decode tokens add temporal reuse: per layer, each of the k picks re-picks, with
  probability ``reuse``, an expert used by that layer in the previous ``window`` tokens
  (of this turn, the prompt's last tokens included), popularity-weighted; otherwise it
  draws from the experts outside that window. (The reuse count is clipped to what the
  window and its complement can supply.)
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

import numpy as np

from freetoken_sglang.observe.routing_trace import RoutingTrace, RoutingTraceWriter


@dataclass
class SyntheticParams:
    """Parameters of ``generate`` (see the module docstring for the model).

    Raises ValueError from ``validate`` on out-of-range values.
    """

    num_layers: int = 16
    num_experts: int = 64
    top_k: int = 4
    sessions: int = 3
    turns: int = 3
    prefill_len: tuple[int, int] = (64, 512)  # tokens per turn prompt, inclusive range
    decode_len: tuple[int, int] = (128, 384)  # decode steps per turn, inclusive range
    prefill_chunk: int = 0  # tokens per prefill step; 0 = the whole prompt in one step
    zipf: float = 1.0  # popularity exponent s: weight of rank r is r**-s
    drift: float = 0.25  # fraction of rank positions reshuffled per session, per layer
    reuse: float = 0.6  # per decode pick: probability of re-picking a recent expert
    window: int = 4  # recent tokens (per layer) that reuse draws from
    seed: int = 0
    model: str = field(default="synthetic")

    def validate(self) -> None:
        if min(self.num_layers, self.num_experts, self.top_k) < 1:
            raise ValueError("num_layers, num_experts and top_k must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} > num_experts={self.num_experts}")
        if self.sessions < 1 or self.turns < 1:
            raise ValueError("sessions and turns must be >= 1")
        for name in ("prefill_len", "decode_len"):
            lo, hi = getattr(self, name)
            if lo < 0 or hi < lo:
                raise ValueError(
                    f"{name} must be a range (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
        if self.prefill_len[0] < 1:
            raise ValueError("prefill_len must be >= 1 token (a turn starts with a prompt)")
        if self.prefill_chunk < 0 or self.window < 0 or self.zipf < 0:
            raise ValueError("prefill_chunk, window and zipf must be >= 0")
        if not (0.0 <= self.drift <= 1.0 and 0.0 <= self.reuse <= 1.0):
            raise ValueError("drift and reuse are fractions in [0, 1]")


def _gumbel_topk(rng, logp: np.ndarray, num_tokens: int, k: int) -> np.ndarray:
    """int [T, L, k]: k distinct experts per token and layer, drawn without replacement with
    probabilities exp(logp) (logp [L, E])."""
    L, E = logp.shape
    out = np.empty((num_tokens, L, k), dtype=np.int64)
    chunk = max(1, (1 << 22) // (L * E))
    for a in range(0, num_tokens, chunk):
        b = min(num_tokens, a + chunk)
        g = logp[None] + rng.gumbel(size=(b - a, L, E))
        out[a:b] = np.argpartition(-g, k - 1, axis=2)[:, :, :k]
    return out


def _decode_token(rng, logp: np.ndarray, recent: np.ndarray, k: int, reuse: float) -> np.ndarray:
    """int [L, k] for one decode token; ``recent`` bool [L, E] marks the reuse window."""
    L, E = logp.shape
    n_rec = recent.sum(axis=1)
    r = rng.binomial(k, reuse, size=L)
    r = np.clip(r, k - (E - n_rec), n_rec)  # window and complement must supply r and k - r
    g = logp + rng.gumbel(size=(L, E))
    rec = np.argsort(-np.where(recent, g, -np.inf), axis=1)[:, :k]
    non = np.argsort(-np.where(recent, -np.inf, g), axis=1)[:, :k]
    j = np.arange(k)[None, :]
    take = np.concatenate([j < r[:, None], j < (k - r)[:, None]], axis=1)
    return np.concatenate([rec, non], axis=1)[take].reshape(L, k)


def generate(params: SyntheticParams) -> RoutingTrace:
    """Make one synthetic routing trace (deterministic in ``params.seed``).

    Returns:
        A RoutingTrace with ``meta.synthetic = True`` and ``meta.generator`` = the parameters.
    """
    p = params
    p.validate()
    rng = np.random.default_rng(p.seed)
    L, E, k = p.num_layers, p.num_experts, p.top_k
    rank_logw = -p.zipf * np.log(np.arange(1, E + 1, dtype=np.float64))
    rank_logw -= np.log(np.exp(rank_logw).sum())
    base = np.stack([rng.permutation(E) for _ in range(L)])  # [L, rank] -> expert
    phases, ntok, chunks = [], [], []
    rows = np.arange(L)[:, None]
    for _ in range(p.sessions):
        perm = base.copy()
        n_drift = int(round(p.drift * E))
        for l in range(L):
            pos = rng.choice(E, size=n_drift, replace=False)
            perm[l, pos] = perm[l, rng.permutation(pos)]
        logp = np.empty((L, E))
        logp[rows, perm] = rank_logw[None, :]
        for _ in range(p.turns):
            P = int(rng.integers(p.prefill_len[0], p.prefill_len[1] + 1))
            pre = _gumbel_topk(rng, logp, P, k)
            step = p.prefill_chunk or P
            for a in range(0, P, step):
                phases.append("prefill")
                ntok.append(min(P, a + step) - a)
                chunks.append(pre[a : a + step])
            hist = list(pre[max(0, P - p.window) :]) if p.window else []
            D = int(rng.integers(p.decode_len[0], p.decode_len[1] + 1))
            for _ in range(D):
                recent = np.zeros((L, E), dtype=bool)
                for h in hist:
                    recent[rows, h] = True
                tok = _decode_token(rng, logp, recent, k, p.reuse)
                phases.append("decode")
                ntok.append(1)
                chunks.append(tok[None])
                if p.window:
                    hist.append(tok)
                    if len(hist) > p.window:
                        hist.pop(0)
    ids = np.concatenate(chunks, axis=0)
    codes = np.array([0 if ph == "prefill" else 1 for ph in phases], dtype=np.uint8)
    meta = {"model": p.model, "synthetic": True,
            "generator": {"source": "benchmarks/synthetic_routing.py", **_params_json(p)}}
    return RoutingTrace(codes, np.array(ntok, dtype=np.int32), ids, E, meta=meta)


def _params_json(p: SyntheticParams) -> dict:
    d = asdict(p)
    d.pop("model")
    d["prefill_len"] = list(p.prefill_len)
    d["decode_len"] = list(p.decode_len)
    return d


def _range(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        vals = [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'N' or 'LO,HI', got {text!r}") from None
    if len(vals) == 1:
        return vals[0], vals[0]
    if len(vals) != 2:
        raise argparse.ArgumentTypeError(f"expected 'N' or 'LO,HI', got {text!r}")
    return vals[0], vals[1]


def add_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """Add one option per SyntheticParams field, named ``--{prefix}{field}``."""
    d = SyntheticParams()
    g = parser.add_argument_group("synthetic routing generator")
    opt = lambda name: f"--{prefix}{name.replace('_', '-')}"  # noqa: E731
    g.add_argument(opt("layers"), type=int, default=d.num_layers, help="L, MoE layers")
    g.add_argument(opt("experts"), type=int, default=d.num_experts, help="E, experts per layer")
    g.add_argument(opt("top_k"), type=int, default=d.top_k, help="k, experts per token")
    g.add_argument(opt("sessions"), type=int, default=d.sessions)
    g.add_argument(opt("turns"), type=int, default=d.turns, help="turns per session")
    g.add_argument(opt("prefill_len"), type=_range, default=d.prefill_len,
                   help="prompt tokens per turn, 'N' or 'LO,HI' (default %(default)s)")
    g.add_argument(opt("decode_len"), type=_range, default=d.decode_len,
                   help="decode steps per turn, 'N' or 'LO,HI' (default %(default)s)")
    g.add_argument(opt("prefill_chunk"), type=int, default=d.prefill_chunk,
                   help="tokens per prefill step, 0 = one step per prompt")
    g.add_argument(opt("zipf"), type=float, default=d.zipf, help="popularity Zipf exponent")
    g.add_argument(opt("drift"), type=float, default=d.drift,
                   help="fraction of ranks reshuffled per session")
    g.add_argument(opt("reuse"), type=float, default=d.reuse,
                   help="probability a decode pick re-picks a recent expert")
    g.add_argument(opt("window"), type=int, default=d.window, help="reuse window, tokens")
    g.add_argument(opt("seed"), type=int, default=d.seed)


def params_from_args(args: argparse.Namespace, prefix: str = "") -> SyntheticParams:
    """SyntheticParams from options added by ``add_args`` with the same prefix."""
    a = lambda name: getattr(args, (prefix + name).replace("-", "_"))  # noqa: E731
    p = SyntheticParams(
        num_layers=a("layers"), num_experts=a("experts"), top_k=a("top_k"),
        sessions=a("sessions"), turns=a("turns"), prefill_len=a("prefill_len"),
        decode_len=a("decode_len"), prefill_chunk=a("prefill_chunk"), zipf=a("zipf"),
        drift=a("drift"), reuse=a("reuse"), window=a("window"), seed=a("seed"),
    )
    p.validate()
    return p


def write(params: SyntheticParams, path: str) -> RoutingTrace:
    """Generate a trace and write it to ``path`` with RoutingTraceWriter; returns it."""
    trace = generate(params)
    meta = {k: v for k, v in trace.meta.items()
            if k not in ("format", "version", "num_layers", "num_experts", "top_k")}
    with RoutingTraceWriter(path, trace.num_layers, trace.num_experts, trace.top_k, meta) as w:
        for phase, ids in trace:
            w.add_step(phase, ids)
    return trace


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="output trace file (.npz)")
    add_args(ap)
    args = ap.parse_args(argv)
    t = write(params_from_args(args), args.out)
    n_dec = int((t.phase == 1).sum())
    print(f"wrote SYNTHETIC trace {args.out}: {t.num_steps} steps ({n_dec} decode), "
          f"{t.ids.shape[0]} tokens, L={t.num_layers} E={t.num_experts} k={t.top_k}")


if __name__ == "__main__":
    main()
