"""Train a small Qwen3-MoE from scratch on text this machine has, report its loss curve, and
record its routing on the agent sessions of ``benchmarks/workloads.py`` as routing traces.

THIS IS A SMALL MODEL'S ROUTING, NOT QWEN3'S. No trained MoE weights are reachable here, so
this script makes some: a ``transformers`` ``Qwen3MoeForCausalLM`` with the target's routed
experts per layer and top-k (default 128 experts, top-8, as Qwen3-30B-A3B) but few layers
and a small hidden size, trained for a stated number of tokens. Its routing has the structure
of a trained top-k router (load-balancing loss, token-dependent expert choice) but says
nothing certain about Qwen3's own expert locality.

Corpus (offline on any machine with Python):
  * the standard library's ``.py`` sources (``sysconfig.get_paths()["stdlib"]``, without
    ``site-packages``/``dist-packages``); their docstrings are the documentation part;
  * the agent sessions of ``benchmarks/workloads.py`` (W1, W2, W4) rendered with the tiny
    models' ChatML template (``freetoken_sglang.tiny_models.CHAT_TEMPLATE``), for workload
    seeds ``1..--session-seeds`` (seed 0, the one traced, is not trained on).
  Documents are split into train / validation by a hash of their name (``--val-frac``).
Tokenizer: a byte-level BPE trained on that corpus with the ``tokenizers`` library
(``--vocab``, default 8192), with the special tokens and chat template of
``freetoken_sglang/tiny_models.py``.

Training: ``Qwen3MoeForCausalLM`` from a config (router aux loss on:
``output_router_logits=True`` so the load-balancing loss with ``router_aux_loss_coef`` is
added, as Qwen3-MoE trains), AdamW, linear warmup then cosine decay to 10% of ``--lr``, bf16
autocast on CUDA (fp32 master weights). Batches are random ``--seq-len`` windows of the
packed training stream. The schedule's progress is ``max(step / planned steps, elapsed /
--time-budget-s)``, so the cosine finishes whichever bound ends training first; training
stops at ``--tokens`` or at ``--time-budget-s``, then the traces are recorded. Every
``--log-every`` steps ``DIR/loss_curve.json`` gets a point: train LM loss (mean since the
last point, without the aux term), aux loss, validation LM loss, tokens seen, tokens/s, and
the routing balance of the training batches since the last point (entropy of the expert
load / log E, and the fraction of experts that receive 90% of the assignments; both averaged
over the MoE layers; 1.0 is perfectly balanced).

Traces: each session (``--trace-sessions``, default W2 and W4 at ``--trace-scale`` 1, seed 0,
the workload's default context edits) is run the way a server with a prefix cache runs it:
request by request, the prompt rendered with the chat template, the KV cache cut to the
longest common prefix with the previous request's tokens (prompt + generated), the new
tokens prefilled in chunks of ``--prefill-chunk`` (one prefill step each; at least one token
is always prefilled), then greedy decoding of the request's ``max_tokens`` (capped by
``--decode-cap``): the prefill's last logits give the first token, and each further token is
one decode step of one token (``max_tokens - 1`` decode steps), as in SGLang. Each MoE
layer's top-k expert ids are taken from the router (forward hooks on ``mlp.gate``). A
session stops before the request that would take its recorded tokens past
``--max-trace-tokens``, or, after its first request, once ``--deadline-s`` seconds have passed
since the script started (so a 10-minute call ends with valid, possibly shorter traces;
meta ``stopped_early`` says which). Files: ``DIR/trace_<W>.npz`` in the format of
``freetoken_sglang/observe/routing_trace.py`` (``RoutingTraceWriter``; readable by
``RoutingTrace.load`` and ``benchmarks/replay.py``), with the metadata ``small_model: true``,
``note`` ("a small model's routing (this script's config), not Qwen3's"), ``config``,
``tokens_trained`` and ``final_val_loss``. The model was trained on ``--seq-len`` windows,
so a session longer than that runs at positions it never saw in training (stated in the
report).

Outputs in ``--out``: ``loss_curve.json``, ``report.md``, ``trace_*.npz``; the weights only
with ``--save-weights`` (``DIR/model/``).

Usage:
    python benchmarks/train_router.py --out DIR [--tokens N] [--time-budget-s S] ...
    # CPU smoke run:
    python benchmarks/train_router.py --out /tmp/tr --device cpu --dtype fp32 --experts 8 \\
        --top-k 2 --layers 2 --hidden 32 --moe-intermediate 16 --heads 2 --kv-heads 1 \\
        --head-dim 16 --seq-len 64 --batch 2 --tokens 512 --vocab 400 \\
        --corpus-max-bytes 300000 --trace-sessions W2 --trace-scale 0.01 --max-requests 2 \\
        --decode-cap 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

NOTE = "a small model's routing (this script's config), not Qwen3's"
MOE_IMPL = "ft_grouped_mm_autocast"


# ---------------------------------------------------------------------------------------
# Corpus and tokenizer
# ---------------------------------------------------------------------------------------


def stdlib_documents(max_bytes: int | None = None) -> list[tuple[str, str]]:
    """(name, text) of the standard library's ``.py`` files in sorted path order, without
    site-/dist-packages, up to ``max_bytes`` characters in all (None: all)."""
    root = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            if max_bytes is not None and total + len(text) > max_bytes:
                if total > 0:
                    return docs
                text = text[:max_bytes]
            docs.append(("stdlib/" + os.path.relpath(path, root), text))
            total += len(text)
    return docs


def _full_request(workload):
    """A Request holding the whole scripted conversation (all messages, no edits)."""
    import workloads as wl

    return wl.Request(workload=workload.name, index=-1, user_turn=0, step=0, kind="answer",
                      messages=workload.script, tools=workload.tools, max_tokens=0)


def session_documents(tokenizer, seeds, scale: float) -> list[tuple[str, str]]:
    """(name, text) of every workload's full conversation, chat-template rendered, per seed."""
    import workloads as wl

    docs = []
    for seed in seeds:
        for name in wl.WORKLOADS:
            w = wl.build(name, scale=scale, seed=seed)
            docs.append((f"session/{name}/seed{seed}", wl.render_text(tokenizer, _full_request(w))))
    return docs


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (``tokenizers``) trained on ``texts``, with the tiny models' special
    tokens and chat template, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from freetoken_sglang.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _bootstrap_tokenizer():
    """A template-only tokenizer for rendering session text before the real one exists."""
    from freetoken_sglang.tiny_models import _train_tokenizer

    return _train_tokenizer(300)


def is_val(name: str, frac: float) -> bool:
    h = int(hashlib.md5(name.encode()).hexdigest()[:8], 16)
    return (h % 10000) < frac * 10000


def build_corpus(args, log):
    """Tokenizer, train ids, val ids (1-D int64 numpy streams, documents joined by
    ``<|endoftext|>``) and a corpus summary dict."""
    import numpy as np

    t0 = time.time()
    docs = stdlib_documents(args.corpus_max_bytes)
    n_std, b_std = len(docs), sum(len(t) for _, t in docs)
    seeds = list(range(1, args.session_seeds + 1))
    sess = session_documents(_bootstrap_tokenizer(), seeds, args.session_scale) if seeds else []
    docs += sess
    b_sess = sum(len(t) for _, t in sess)
    log(f"corpus: {n_std} stdlib files ({b_std / 1e6:.2f} MB), {len(sess)} session renderings "
        f"({b_sess / 1e6:.2f} MB) in {time.time() - t0:.1f}s")
    t0 = time.time()
    tok = train_tokenizer([t for _, t in docs], args.vocab)
    log(f"tokenizer: byte-level BPE, vocab {len(tok)} trained in {time.time() - t0:.1f}s")
    t0 = time.time()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    enc = tok.backend_tokenizer.encode_batch([t for _, t in docs], add_special_tokens=False)
    train, val = [], []
    tr_docs = va_docs = 0
    for (name, _), e in zip(docs, enc):
        dest = val if is_val(name, args.val_frac) else train
        dest.append(np.asarray(e.ids + [eot], dtype=np.int64))
        if dest is val:
            va_docs += 1
        else:
            tr_docs += 1
    if not val:  # always hold something out: the last training document
        val.append(train.pop())
        tr_docs, va_docs = tr_docs - 1, 1
    train_ids, val_ids = np.concatenate(train), np.concatenate(val)
    need = args.seq_len + 1
    if len(val_ids) < need:  # repeat a tiny validation stream up to one window
        val_ids = np.tile(val_ids, -(-need // len(val_ids)))
    log(f"tokenized: train {len(train_ids):,} tokens ({tr_docs} docs), val {len(val_ids):,} "
        f"({va_docs} docs), {(b_std + b_sess) / max(1, len(train_ids) + len(val_ids)):.2f} "
        f"chars/token, {time.time() - t0:.1f}s")
    summary = {
        "stdlib_root": sysconfig.get_paths()["stdlib"], "stdlib_files": n_std,
        "stdlib_chars": b_std, "session_renderings": len(sess), "session_chars": b_sess,
        "session_seeds": seeds, "session_scale": args.session_scale,
        "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)),
        "train_docs": tr_docs, "val_docs": va_docs, "val_frac": args.val_frac,
        "tokenizer": f"byte-level BPE trained on this corpus (tokenizers), vocab {len(tok)}",
    }
    return tok, train_ids, val_ids, summary


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


def _register_moe_impl() -> bool:
    """Register a grouped-GEMM experts forward that casts weights and inputs to the autocast
    dtype (transformers' own ``grouped_mm`` casts the input to the fp32 master weights).
    Returns False when this transformers has no experts interface."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    import torch
    import torch.nn.functional as F

    gmm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if gmm is None:
        return False

    def forward(self, hidden_states, top_k_index, top_k_weights):
        dev = hidden_states.device
        dt = (torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type)
              else self.gate_up_proj.dtype)
        k = top_k_index.size(-1)
        flat = top_k_index.reshape(-1)
        expert_g, perm = torch.sort(flat)
        # histc, not bincount: no device sync (CUDA histc takes ints, CPU histc floats)
        hin = expert_g.int() if dev.type == "cuda" else expert_g.float()
        counts = torch.histc(hin, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        x = hidden_states[perm // k].to(dt)
        gate_up = gmm(x, self.gate_up_proj.to(dt).transpose(-2, -1), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        out = gmm(h, self.down_proj.to(dt).transpose(-2, -1), offs=offs)
        out = out.float() * top_k_weights.reshape(-1)[perm].float().unsqueeze(-1)
        final = torch.zeros(hidden_states.shape, dtype=torch.float32, device=dev)
        final.index_add_(0, perm // k, out)
        return final.to(hidden_states.dtype)

    ExpertsInterface.register(MOE_IMPL, forward)
    return True


def model_config(args, vocab: int, eos_id: int, pad_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate_size=args.moe_intermediate * 2,
        moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, initializer_range=0.02,
        tie_word_embeddings=False, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
        output_router_logits=True, router_aux_loss_coef=args.aux_coef,
    )


def build_model(args, cfg, device):
    import torch
    from transformers import Qwen3MoeForCausalLM

    impl = None
    if device.type == "cuda" and _register_moe_impl():
        impl = MOE_IMPL
    elif device.type == "cpu":
        impl = "eager"
    kw = {"attn_implementation": "sdpa"}
    if impl is not None:
        kw["experts_implementation"] = impl
    torch.manual_seed(args.seed)
    try:
        model = Qwen3MoeForCausalLM._from_config(cfg, **kw)
    except (TypeError, ValueError, KeyError):
        kw.pop("experts_implementation", None)
        impl = None
        model = Qwen3MoeForCausalLM._from_config(cfg, **kw)
    return model.to(device), impl or "transformers default"


def moe_gates(model):
    """The router (``mlp.gate``) of every MoE layer, in layer order."""
    gates = []
    for layer in model.model.layers:
        g = getattr(layer.mlp, "gate", None)
        if g is not None and hasattr(layer.mlp, "experts"):
            gates.append(g)
    return gates


# ---------------------------------------------------------------------------------------
# Balance statistics
# ---------------------------------------------------------------------------------------


def balance_stats(counts) -> dict:
    """counts: numpy [L, E] assignments per expert. Mean over layers of the normalised load
    entropy H/log(E), the fraction of experts holding 90% of the assignments, and max/mean."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.float64)
    E = counts.shape[1]
    ent, f90, mx = [], [], []
    for c in counts:
        tot = c.sum()
        if tot <= 0:
            continue
        p = c / tot
        nz = p[p > 0]
        ent.append(float(-(nz * np.log(nz)).sum() / math.log(E)))
        s = np.sort(p)[::-1]
        f90.append(float((np.searchsorted(np.cumsum(s), 0.9 - 1e-12) + 1) / E))
        mx.append(float(s[0] * E))
    if not ent:
        return {"load_entropy": None, "experts_for_90pct": None, "max_over_mean_load": None}
    return {"load_entropy": float(np.mean(ent)), "experts_for_90pct": float(np.mean(f90)),
            "max_over_mean_load": float(np.mean(mx))}


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


def _lr_at(progress: float, args, warmup_frac: float) -> float:
    if progress < warmup_frac:
        return args.lr * max(progress / warmup_frac, 1e-3)
    t = min(1.0, (progress - warmup_frac) / max(1e-9, 1 - warmup_frac))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args, model, cfg, train_ids, val_ids, device, log, curve_path):
    import numpy as np
    import torch

    B, S = args.batch, args.seq_len
    per_step = B * S
    steps = max(1, -(-args.tokens // per_step))
    rng = np.random.default_rng(args.seed)
    train_t = torch.from_numpy(train_ids)
    hi = len(train_ids) - S
    if hi <= 0:
        raise ValueError(f"training stream ({len(train_ids)} tokens) shorter than --seq-len {S}")
    vr = np.random.default_rng(args.seed + 1)
    vhi = max(1, len(val_ids) - S)
    val_t = torch.from_numpy(val_ids)
    val_starts = vr.integers(0, vhi, size=(args.val_batches, B))
    use_amp = device.type == "cuda" and args.dtype == "bf16"
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay, eps=1e-8, fused=fused)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    L = len(moe_gates(model))
    coef = cfg.router_aux_loss_coef

    def window(t, starts):
        idx = torch.as_tensor(starts)[:, None] + torch.arange(S)[None, :]
        return t[idx].to(device, non_blocking=True)

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot = 0.0
        for starts in val_starts:
            x = window(val_t, starts)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                out = model(input_ids=x, labels=x, output_router_logits=False)
            tot += float(out.loss)
        model.train()
        return tot / len(val_starts)

    curve = {"note": NOTE, "tokens_per_step": per_step, "planned_steps": steps,
             "planned_tokens": steps * per_step, "time_budget_s": args.time_budget_s,
             "points": []}
    counts = torch.zeros(L, E, dtype=torch.long, device=device)
    ones = torch.ones(B * S * k, dtype=torch.long, device=device)
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)
    n_acc = 0
    model.train()
    t_start = time.time()
    t_last, tok_last = t_start, 0
    step = 0
    stop_reason = "tokens"
    v0 = evaluate()
    curve["points"].append({"step": 0, "tokens": 0, "train_loss": None, "aux_loss": None,
                            "val_loss": v0, "lr": 0.0, "tokens_per_s": None,
                            "elapsed_s": 0.0, "load_entropy": None,
                            "experts_for_90pct": None, "max_over_mean_load": None})
    log(f"step 0: val_loss {v0:.4f} (ln V = {math.log(cfg.vocab_size):.3f})")
    while step < steps:
        elapsed = time.time() - t_start
        if args.time_budget_s and elapsed >= args.time_budget_s:
            stop_reason = "time budget"
            break
        progress = max(step / steps, elapsed / args.time_budget_s if args.time_budget_s else 0)
        lr = _lr_at(progress, args, args.warmup_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        x = window(train_t, rng.integers(0, hi, size=B))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            out = model(input_ids=x, labels=x, output_router_logits=True)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        with torch.no_grad():
            aux = out.aux_loss.float() if out.aux_loss is not None else torch.zeros((), device=device)
            aux_sum += aux
            loss_sum += loss.float() - coef * aux
            n_acc += 1
            for li, rl in enumerate(out.router_logits[:L]):
                ids = rl.topk(k, dim=-1).indices.reshape(-1)
                counts[li].scatter_add_(0, ids, ones[: ids.numel()])
        if step % args.log_every == 0 or step == steps:
            _log_point(args, curve, step, per_step, loss_sum, aux_sum, n_acc, counts, lr,
                       t_start, t_last, tok_last, evaluate, log, curve_path)
            loss_sum.zero_(); aux_sum.zero_(); counts.zero_()
            n_acc = 0
            t_last, tok_last = time.time(), step * per_step
    if n_acc:  # the last partial interval (time budget)
        _log_point(args, curve, step, per_step, loss_sum, aux_sum, n_acc, counts, lr,
                   t_start, t_last, tok_last, evaluate, log, curve_path)
    curve["steps"] = step
    curve["tokens_trained"] = step * per_step
    curve["stop_reason"] = stop_reason
    curve["train_s"] = time.time() - t_start
    last = curve["points"][-1]
    curve["final_val_loss"] = last["val_loss"]
    _write_json(curve_path, curve)
    return curve


def _log_point(args, curve, step, per_step, loss_sum, aux_sum, n_acc, counts, lr, t_start,
               t_last, tok_last, evaluate, log, curve_path):
    now = time.time()
    tokens = step * per_step
    bal = balance_stats(counts.cpu().numpy())
    tl, al = float(loss_sum) / n_acc, float(aux_sum) / n_acc
    vl = evaluate()
    tps = (tokens - tok_last) / max(1e-9, now - t_last)
    pt = {"step": step, "tokens": tokens, "train_loss": tl, "aux_loss": al, "val_loss": vl,
          "lr": lr, "tokens_per_s": tps, "elapsed_s": now - t_start, **bal}
    curve["points"].append(pt)
    _write_json(curve_path, curve)
    log(f"step {step}: tokens {tokens:,} train_loss {tl:.4f} val_loss {vl:.4f} aux {al:.4f} "
        f"lr {lr:.2e} tok/s {tps:,.0f} load_entropy {bal['load_entropy']:.3f} "
        f"experts_for_90pct {bal['experts_for_90pct']:.3f}")


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# Routing traces
# ---------------------------------------------------------------------------------------


class _GateRecorder:
    """Forward hooks on every ``mlp.gate``: the top-k ids of the last forward, [T, L, k]."""

    def __init__(self, gates, top_k):
        self.top_k = top_k
        self.gates = gates
        self.buf = [None] * len(gates)
        self.handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(gates)]

    def _hook(self, i):
        def hook(module, inputs, output):
            if isinstance(output, tuple):  # transformers 5: (router_logits, scores, indices)
                self.buf[i] = output[2].detach()
            else:  # transformers 4: the gate is a Linear returning the router logits
                logits = output.detach().reshape(-1, output.shape[-1])
                self.buf[i] = logits.float().softmax(-1).topk(self.top_k, dim=-1).indices
        return hook

    def take(self):
        import torch

        ids = torch.stack([b for b in self.buf], dim=1)  # [T, L, k]
        self.buf = [None] * len(self.gates)
        return ids.to("cpu").numpy()

    def close(self):
        for h in self.handles:
            h.remove()


def record_session(args, model, cfg, tok, name, device, path, meta_base, log, deadline=None):
    import numpy as np
    import torch
    from transformers import DynamicCache

    import workloads as wl
    from freetoken_sglang.observe.routing_trace import RoutingTraceWriter

    w = wl.build(name, scale=args.trace_scale, seed=args.trace_seed)
    reqs = w.requests(decode_cap=args.decode_cap)
    if args.max_requests:
        reqs = reqs[:args.max_requests]
    use_amp = device.type == "cuda" and args.dtype == "bf16"
    gates = moe_gates(model)
    rec = _GateRecorder(gates, cfg.num_experts_per_tok)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    meta = dict(meta_base)
    meta.update(workload=name, workload_scale=args.trace_scale, workload_seed=args.trace_seed,
                edits=list(w.default_edits), decode_cap=args.decode_cap, ids_ranked=True,
                prefill_chunk=args.prefill_chunk, max_trace_tokens=args.max_trace_tokens)
    per_req = []
    stopped = None
    cached: list[int] = []
    cache = DynamicCache(config=cfg) if _cache_takes_config() else DynamicCache()
    recorded = 0
    counts = {"prefill": np.zeros((len(gates), E), np.int64),
              "decode": np.zeros((len(gates), E), np.int64)}
    t0 = time.time()
    model.eval()
    writer = RoutingTraceWriter(path, len(gates), E, k, meta=meta)
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            for r in reqs:
                ids = wl.render_ids(tok, r)
                p = min(wl.common_prefix(ids, cached), len(ids) - 1)
                new = len(ids) - p
                if args.max_trace_tokens and recorded + new + r.max_tokens - 1 > args.max_trace_tokens:
                    stopped = "max-trace-tokens"
                if deadline is not None and time.time() > deadline and per_req:
                    stopped = "deadline"
                if stopped:
                    log(f"  {name}: stop before request {r.index} of {len(reqs)} ({stopped})")
                    break
                cache.crop(p)
                logits = None
                for a in range(p, len(ids), args.prefill_chunk):
                    b = min(len(ids), a + args.prefill_chunk)
                    x = torch.tensor([ids[a:b]], device=device)
                    out = model(input_ids=x, past_key_values=cache, use_cache=True,
                                output_router_logits=False, logits_to_keep=1,
                                position_ids=torch.arange(a, b, device=device)[None])
                    cache = out.past_key_values
                    logits = out.logits[0, -1]
                    step_ids = rec.take()
                    writer.add_step("prefill", step_ids)
                    _count(counts["prefill"], step_ids, E)
                nxt = int(logits.argmax())
                gen = [nxt]
                pos = len(ids)
                for _ in range(r.max_tokens - 1):
                    x = torch.tensor([[nxt]], device=device)
                    out = model(input_ids=x, past_key_values=cache, use_cache=True,
                                output_router_logits=False,
                                position_ids=torch.tensor([[pos]], device=device))
                    cache = out.past_key_values
                    step_ids = rec.take()
                    writer.add_step("decode", step_ids)
                    _count(counts["decode"], step_ids, E)
                    nxt = int(out.logits[0, -1].argmax())
                    gen.append(nxt)
                    pos += 1
                cached = ids + gen[:-1]  # what the KV cache holds now
                recorded += new + r.max_tokens - 1
                per_req.append({"index": r.index, "prompt_tokens": len(ids),
                                "cached_prefix": p, "prefill_tokens": new,
                                "decode_steps": r.max_tokens - 1, "max_tokens": r.max_tokens})
        writer.meta["requests"] = per_req
        writer.meta["session_requests"] = len(reqs)
        writer.meta["stopped_early"] = stopped
        writer.close()
    finally:
        rec.close()
    dt = time.time() - t0
    info = {"workload": name, "file": os.path.basename(path), "bytes": os.path.getsize(path),
            "requests": len(per_req), "session_requests": len(reqs), "stopped_early": stopped,
            "steps": writer.num_steps,
            "prefill_tokens": sum(q["prefill_tokens"] for q in per_req),
            "decode_steps": sum(q["decode_steps"] for q in per_req),
            "max_prompt_tokens": max((q["prompt_tokens"] for q in per_req), default=0),
            "record_s": dt, "balance_prefill": balance_stats(counts["prefill"]),
            "balance_decode": balance_stats(counts["decode"])}
    log(f"  {name}: {info['requests']} requests, {info['steps']} steps, "
        f"{info['prefill_tokens']:,} prefill tokens, {info['decode_steps']:,} decode steps, "
        f"prompts up to {info['max_prompt_tokens']:,} tokens, {dt:.1f}s -> {path} "
        f"({info['bytes']:,} bytes)")
    return info


def _cache_takes_config() -> bool:
    import inspect

    from transformers import DynamicCache

    return "config" in inspect.signature(DynamicCache.__init__).parameters


def _count(acc, step_ids, E):
    import numpy as np

    for li in range(step_ids.shape[1]):
        acc[li] += np.bincount(step_ids[:, li].reshape(-1).astype(np.int64), minlength=E)


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def _fmt(v, spec=".4f"):
    return "—" if v is None else format(v, spec)


def write_report(path, argv, args, config, corpus, curve, traces, device_desc, impl):
    pts = curve["points"]
    every = max(1, -(-len(pts) // args.report_points))
    shown = pts[::every]
    if shown[-1] is not pts[-1]:
        shown.append(pts[-1])
    lines = [
        "# Routing of a small trained MoE (train_router.py)", "",
        f"**This is a small model's routing ({NOTE.split('(')[1].split(')')[0]}), not Qwen3's.** "
        "A Qwen3-MoE-shaped model with the target's experts per layer and top-k, trained "
        "from scratch here on a small corpus; its traces show how *a* trained top-k router "
        "routes agent sessions, not how Qwen3 does.", "",
        "## Command", "", "```", "python benchmarks/train_router.py " + " ".join(argv), "```", "",
        f"Device: {device_desc}; dtype {args.dtype}; experts implementation: {impl}.", "",
        "## Config", "", "```json", json.dumps(config, indent=1), "```", "",
        "## Corpus and tokenizer", "",
        f"- stdlib sources: {corpus['stdlib_files']} files, {corpus['stdlib_chars']:,} chars "
        f"({corpus['stdlib_root']})",
        f"- agent sessions (W1, W2, W4, seeds {corpus['session_seeds'][:1]}..."
        f"{corpus['session_seeds'][-1:]}, scale {corpus['session_scale']}): "
        f"{corpus['session_renderings']} renderings, {corpus['session_chars']:,} chars"
        if corpus["session_seeds"] else "- agent sessions: none",
        f"- tokenizer: {corpus['tokenizer']}",
        f"- train {corpus['train_tokens']:,} tokens ({corpus['train_docs']} docs), validation "
        f"{corpus['val_tokens']:,} tokens ({corpus['val_docs']} docs held out by name hash)", "",
        "## Training", "",
        f"- tokens trained: **{curve['tokens_trained']:,}** ({curve['steps']} steps x "
        f"{curve['tokens_per_step']:,} tokens; planned {curve['planned_tokens']:,}; stopped by "
        f"{curve['stop_reason']}) in {curve['train_s']:.1f} s",
        f"- final validation loss: **{_fmt(curve['final_val_loss'])}** nats/token "
        f"(ln V = {math.log(config['vocab_size']):.3f})", "",
        "| step | tokens | train loss | val loss | aux loss | lr | tok/s | load entropy | "
        "experts for 90% |", "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in shown:
        lines.append(
            f"| {p['step']} | {p['tokens']:,} | {_fmt(p['train_loss'])} | {_fmt(p['val_loss'])} "
            f"| {_fmt(p['aux_loss'])} | {_fmt(p['lr'], '.2e')} | {_fmt(p['tokens_per_s'], ',.0f')} "
            f"| {_fmt(p['load_entropy'], '.3f')} | {_fmt(p['experts_for_90pct'], '.3f')} |")
    lines += [
        "", "Losses are LM cross-entropy (nats/token) without the aux term; train loss is the "
        "mean since the previous point. Balance (training batches since the previous point, "
        "mean over MoE layers): load entropy = H(expert load)/ln E (1 = uniform), experts for "
        "90% = fraction of experts receiving 90% of the top-k assignments (0.9 = uniform).", "",
        "## Routing traces", "",
        "Format `freetoken-routing-trace` v1 (`freetoken_sglang/observe/routing_trace.py`), "
        "meta `small_model: true`, `note`, `config`, `tokens_trained`, `final_val_loss`, "
        "`requests`. Replay: `python benchmarks/replay.py DIR/trace_W2.npz ... --out-dir OUT`.",
        "",
        "| file | bytes | requests (of session) | steps | prefill tokens | decode steps | max prompt | "
        "prefill load entropy | decode load entropy | decode experts for 90% | record s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in traces:
        lines.append(
            f"| {t['file']} | {t['bytes']:,} | {t['requests']} ({t['session_requests']}"
            f"{', stopped: ' + t['stopped_early'] if t['stopped_early'] else ''}) | {t['steps']} | "
            f"{t['prefill_tokens']:,} | {t['decode_steps']:,} | {t['max_prompt_tokens']:,} | "
            f"{_fmt(t['balance_prefill']['load_entropy'], '.3f')} | "
            f"{_fmt(t['balance_decode']['load_entropy'], '.3f')} | "
            f"{_fmt(t['balance_decode']['experts_for_90pct'], '.3f')} | {t['record_s']:.1f} |")
    if traces and max(t["max_prompt_tokens"] for t in traces) > args.seq_len:
        lines += ["", f"Caveat: the model was trained on {args.seq_len}-token windows; sessions "
                  "longer than that run at positions it never saw in training."]
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    m = ap.add_argument_group("model (Qwen3-MoE)")
    m.add_argument("--experts", type=int, default=128)
    m.add_argument("--top-k", type=int, default=8)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--moe-intermediate", type=int, default=128)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--head-dim", type=int, default=64)
    m.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    m.add_argument("--aux-coef", type=float, default=0.001, help="router_aux_loss_coef")
    t = ap.add_argument_group("training")
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--tokens", type=int, default=20_000_000, help="total training tokens")
    t.add_argument("--time-budget-s", type=float, default=0.0,
                   help="stop training after this many seconds (0: no limit)")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup-frac", type=float, default=0.05)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default=None, help="cuda if available, else cpu")
    t.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: autocast on CUDA (fp32 master weights); CPU always runs fp32")
    t.add_argument("--log-every", type=int, default=50, help="steps between loss-curve points")
    t.add_argument("--val-batches", type=int, default=4)
    t.add_argument("--val-frac", type=float, default=0.01)
    t.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    c = ap.add_argument_group("corpus")
    c.add_argument("--corpus-max-bytes", type=int, default=None,
                   help="cap on the stdlib characters (default: all)")
    c.add_argument("--session-seeds", type=int, default=16,
                   help="workload seeds 1..N rendered into the corpus (0: none)")
    c.add_argument("--session-scale", type=float, default=1.0)
    r = ap.add_argument_group("traces")
    r.add_argument("--trace-sessions", default="W2,W4", help="comma-separated workloads")
    r.add_argument("--trace-scale", type=float, default=1.0)
    r.add_argument("--trace-seed", type=int, default=0)
    r.add_argument("--max-trace-tokens", type=int, default=500_000,
                   help="per session: stop before the request that passes this many recorded "
                        "tokens (prefill + decode; 0: no cap)")
    r.add_argument("--decode-cap", type=int, default=None, help="cap on decode tokens per request")
    r.add_argument("--max-requests", type=int, default=0, help="requests per session (0: all)")
    r.add_argument("--prefill-chunk", type=int, default=8192)
    r.add_argument("--deadline-s", type=float, default=0.0,
                   help="wall-clock seconds from the start after which no further request is "
                        "traced (the traces written so far stay valid, meta stopped_early; 0: none)")
    ap.add_argument("--save-weights", action="store_true", help="also save DIR/model/")
    ap.add_argument("--report-points", type=int, default=20, help="rows of the report's table")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(f"[train_router {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    t_all = time.time()
    tok, train_ids, val_ids, corpus = build_corpus(args, log)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = model_config(args, len(tok), eos, pad)
    model, impl = build_model(args, cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    device_desc = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({torch.get_num_threads()} threads)")
    log(f"model: Qwen3MoeForCausalLM {n_params / 1e6:.1f}M params, E={args.experts} "
        f"k={args.top_k} L={args.layers} h={args.hidden} on {device_desc}, experts impl {impl}")
    config = {"architecture": "Qwen3MoeForCausalLM", "vocab_size": len(tok),
              "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
              "head_dim": args.head_dim, "moe_intermediate_size": args.moe_intermediate,
              "num_experts": args.experts, "num_experts_per_tok": args.top_k,
              "norm_topk_prob": True, "router_aux_loss_coef": args.aux_coef,
              "parameters": n_params, "seq_len": args.seq_len, "batch": args.batch,
              "lr": args.lr, "warmup_frac": args.warmup_frac,
              "weight_decay": args.weight_decay, "seed": args.seed, "dtype": args.dtype}
    curve_path = os.path.join(args.out, "loss_curve.json")
    curve = train(args, model, cfg, train_ids, val_ids, device, log, curve_path)
    curve.update(config=config, corpus=corpus, command=argv)
    _write_json(curve_path, curve)
    log(f"trained {curve['tokens_trained']:,} tokens in {curve['train_s']:.1f}s "
        f"({curve['stop_reason']}), final val loss {curve['final_val_loss']:.4f}")

    meta_base = {"model": f"train_router small Qwen3-MoE (E={args.experts}, k={args.top_k}, "
                          f"L={args.layers}, hidden={args.hidden})",
                 "family": "Qwen3-MoE (small, trained here)", "synthetic": False,
                 "small_model": True, "note": NOTE, "config": config,
                 "tokens_trained": curve["tokens_trained"],
                 "final_val_loss": curve["final_val_loss"], "generator": "benchmarks/train_router.py",
                 "tokenizer": corpus["tokenizer"]}
    traces = []
    names = [s.strip() for s in args.trace_sessions.split(",") if s.strip()]
    log(f"recording traces: {names}")
    deadline = t_all + args.deadline_s if args.deadline_s else None
    write_report(os.path.join(args.out, "report.md"), argv, args, config, corpus, curve,
                 traces, device_desc, impl)  # rewritten with the traces below
    for name in names:
        path = os.path.join(args.out, f"trace_{name}.npz")
        traces.append(record_session(args, model, cfg, tok, name, device, path, meta_base, log,
                                     deadline))
    curve["traces"] = traces
    _write_json(curve_path, curve)
    if args.save_weights:
        model.save_pretrained(os.path.join(args.out, "model"))
        tok.save_pretrained(os.path.join(args.out, "model"))
    write_report(os.path.join(args.out, "report.md"), argv, args, config, corpus, curve,
                 traces, device_desc, impl)
    log(f"done in {time.time() - t_all:.1f}s: {args.out}/report.md")
    return curve


if __name__ == "__main__":
    main()
