"""GPU step cost of the layer-skip draft path vs the full model, for real model shapes.

    python -m benchmarks.gpu_step_cost                      # on a CUDA machine, ~3-6 minutes
    python -m benchmarks.gpu_step_cost --tiny --device cpu  # dry run in seconds (the tests do this)

Plain PyTorch, no vLLM (the GPU machines have none) and no checkpoint: every model is built with
random bf16 weights of the real shapes, which is all a step *cost* depends on:

============  ======  =============  =====  ==  =====  ======  ============================
model         hidden  layers         heads  kv  inter  vocab   skip set (draft path)
============  ======  =============  =====  ==  =====  ======  ============================
llama-2-13b   5120    40             40     40  13824  32000   ``llama-2-13b.draft-verify``
llama-2-70b   8192    80 (40 built)  64     8   28672  32000   ``llama-2-70b.draft-verify``
llama-3-8b    4096    32             32     8   14336  128256  depth default (no profile)
smollm2-135m  576     30             9      3   1536   49152   ``smollm2-135m-instruct``
  -zero60     576     60             9      3   1536   49152   the 30 inserted zero layers
============  ======  =============  =====  ==  =====  ======  ============================

The skip sets are the shipped profiles (``vllm_selfspec.layers.profiles.load_profile``;
stdlib-only, no vLLM import). Llama-3-8B has no published skip set: it gets
``config.default_skip_set`` (the
attention of a quarter of the layers, upper half). LLaMA-2-70B does not fit one GPU in bf16 with a
KV cache, so 40 of its 80 layers are built and the full-depth costs are projected (below).

For each model and batch size B (1..64), with a KV cache holding ``--context`` tokens per sequence,
the script times one decode step (embedding, decoder layers, final norm, LM head over every query
position, argmax), eager and as a replayed CUDA graph:

* ``full``: the full model, 1 token per sequence (plain decoding's step);
* ``draft``: the draft path, the profile's attention / MLP sub-layers skipped, 1 token;
* ``no_attn`` / ``no_mlp``: every attention / every MLP sub-layer skipped (for the linear model);
* ``verify_k``: the full model over ``1 + k`` tokens per sequence (the verification of k drafts);
* ``pass_k`` (models built at full depth): the draft pass as the device drafter runs it, ``k``
  draft steps of one token per sequence, each step's top-1 token (and its probability) fed to the
  next on the device, positions advancing; as a CUDA graph it is one captured graph per pass;
* ``host_pass_s`` (eager only): the same pass as the host drafter runs it, each step's tokens
  read to the host (a device sync per draft token) and sent back.

``smollm2-135m-zero60`` is the free-draft model of the benchmarks (``--insert-zero-layers 30``):
every odd layer is an inserted layer whose o_proj and down_proj are zero, and the draft skips
exactly those, so its drafts are the full model's own tokens; the script checks that (logits bit
for bit, and 8 chained greedy tokens, against the full model run twice as the control).

Per-layer costs follow from the linear model ``step = base + n_attn*c_attn + n_mlp*c_mlp``
(``c_attn = (full - no_attn)/L``, ``c_mlp = (full - no_mlp)/L``); the projected draft cost of a skip
set is ``base + (L - |skip_attention|) c_attn + (L - |skip_mlp|) c_mlp``. For the models built at
full depth the measured ``draft`` checks that projection; for LLaMA-2-70B the 80-layer costs are
projections from the 40-layer model.

The output is the cost ratio ``r = c_draft / c_verify`` and projected speedups for acceptance
rates ``a`` in ``--acceptance`` (default 0.7, 0.8, 0.9, 0.95: the range that Draft & Verify and
SWIFT report for LLaMA-2 with searched skip sets, SWIFT stating 90-100 % draft acceptance; third
party reproductions found less, see method.md section 5):

    speedup(a, k) = E(a, k) * c_full / (k * c_draft + c_verify_k),   E = (1 - a^(k+1)) / (1 - a)

maximised over k in 1..8 (``c_verify_k`` interpolated between measured k). Two draft-path costs
are reported: ``eager`` (what the plugin does today: draft steps run eagerly while vLLM runs the
verification as a CUDA graph) and ``graph`` (a captured draft step, the planned next step).
Results go to ``$OUT`` when set (the device machine's output folder), else ``benchmarks/results``:
``gpu_step_cost.json`` and ``gpu_step_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int  # the real depth
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    profile: str | None  # shipped profile name; None: vllm_selfspec.config.default_skip_set
    build_layers: int | None = None  # build fewer layers than the real depth (then project)
    # every odd layer is an inserted zero-output layer (its o_proj and down_proj are zero) and the
    # draft skips exactly those: free drafts, the draft equals the model without them
    zero_inserted: bool = False


SHAPES: dict[str, Shape] = {
    "llama-2-13b": Shape("llama-2-13b", 5120, 40, 40, 40, 13824, 32000,
                         "llama-2-13b.draft-verify"),
    "llama-2-70b": Shape("llama-2-70b", 8192, 80, 64, 8, 28672, 32000,
                         "llama-2-70b.draft-verify", build_layers=40),
    "llama-3-8b": Shape("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, None),
    "smollm2-135m": Shape("smollm2-135m", 576, 30, 9, 3, 1536, 49152,
                          "smollm2-135m-instruct"),
    "smollm2-135m-zero60": Shape("smollm2-135m-zero60", 576, 60, 9, 3, 1536, 49152, None,
                                 zero_inserted=True),
}
TINY = Shape("tiny", 64, 4, 4, 2, 128, 256, None)

DEFAULT_ACCEPTANCE = (0.7, 0.8, 0.9, 0.95)
VERIFY_KS = (1, 2, 4, 8)
PASS_KS = (1, 4, 8)  # draft tokens per row in one draft pass


def skip_sets(shape: Shape) -> tuple[list[int], list[int], str]:
    """(skip_attention, skip_mlp, where they come from) for the real depth of ``shape``."""
    if shape.zero_inserted:
        odd = list(range(1, shape.layers, 2))
        return odd, odd, "the inserted zero-output layers"
    if shape.profile:
        from vllm_selfspec.layers.profiles import load_profile

        prof = load_profile(shape.profile)
        if prof.model.num_hidden_layers != shape.layers:
            raise ValueError(f"profile {shape.profile} is for {prof.model.num_hidden_layers} "
                             f"layers, shape {shape.name} has {shape.layers}")
        return list(prof.skip_attention), list(prof.skip_mlp), f"profile {shape.profile}"
    try:
        from vllm_selfspec.config import default_skip_set

        attn, mlp = default_skip_set(shape.layers)
        return list(attn), list(mlp), "vllm_selfspec.config.default_skip_set"
    except ImportError:  # pragma: no cover - the package is carried along with the script
        n = shape.layers
        first, last, count = max(2, n // 2), n - 2, n // 4
        span = last - first + 1
        return ([first + int((i + 0.5) * span / count) for i in range(count)], [],
                "depth default")


# ------------------------------------------------------------------------------------- model

class RandomLlama:
    """A Llama decoder (RMSNorm, RoPE, GQA attention over a static KV cache, SwiGLU MLP) with
    random weights; ``step`` runs one forward of ``s`` new tokens per sequence at a fixed
    position, with chosen sub-layers skipped."""

    def __init__(self, shape: Shape, n_layers: int, max_batch: int, context: int,
                 device: torch.device, dtype: torch.dtype, max_new: int = 16) -> None:
        self.shape, self.n_layers, self.device, self.dtype = shape, n_layers, device, dtype
        self.context = context
        self.head_dim = shape.hidden // shape.heads
        g = torch.Generator(device=device).manual_seed(0)

        def w(*size: int) -> torch.Tensor:
            t = torch.empty(*size, device=device, dtype=dtype)
            return t.normal_(0.0, 0.02, generator=g)

        h, kvd = shape.hidden, shape.kv_heads * self.head_dim
        self.embed = w(shape.vocab, h)
        self.lm_head = w(shape.vocab, h)
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.layers = []
        for i in range(n_layers):
            self.layers.append({
                "ln1": torch.ones(h, device=device, dtype=dtype),
                "ln2": torch.ones(h, device=device, dtype=dtype),
                "wqkv": w(h + 2 * kvd, h), "wo": w(h, h),
                "wgu": w(2 * shape.intermediate, h), "wd": w(h, shape.intermediate),
            })
            if shape.zero_inserted and i % 2 == 1:  # an inserted layer: adds exactly zero
                self.layers[-1]["wo"].zero_()
                self.layers[-1]["wd"].zero_()
        total = context + max_new
        kv_shape = (max_batch, shape.kv_heads, total, self.head_dim)
        self.cache = [(w(*kv_shape), w(*kv_shape)) for _ in range(n_layers)]
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=device).float()
                               / self.head_dim))
        ang = torch.outer(torch.arange(total, device=device).float(), inv)
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)
        self._gqa = _sdpa_supports_gqa()

    def free(self) -> None:
        """Drop the weights and the KV cache (before building the next model)."""
        self.layers, self.cache = [], []
        self.embed = self.lm_head = torch.empty(0)

    def param_bytes(self) -> int:
        n = self.embed.numel() + self.lm_head.numel()
        for lay in self.layers:
            n += sum(t.numel() for t in lay.values())
        return n * self.embed.element_size()

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, pos0: int, s: int) -> torch.Tensor:
        cos, sin = self.cos[pos0:pos0 + s], self.sin[pos0:pos0 + s]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _attn(self, i: int, x: torch.Tensor, pos0: int) -> torch.Tensor:
        sh, hd = self.shape, self.head_dim
        b, s, h = x.shape
        qkv = F.linear(x, self.layers[i]["wqkv"])
        q, k, v = qkv.split([h, sh.kv_heads * hd, sh.kv_heads * hd], dim=-1)
        q = self._rope(q.view(b, s, sh.heads, hd).transpose(1, 2), pos0, s)
        k = self._rope(k.view(b, s, sh.kv_heads, hd).transpose(1, 2), pos0, s)
        v = v.view(b, s, sh.kv_heads, hd).transpose(1, 2)
        ck, cv = self.cache[i]
        ck[:b, :, pos0:pos0 + s] = k
        cv[:b, :, pos0:pos0 + s] = v
        keys, values = ck[:b, :, :pos0 + s], cv[:b, :, :pos0 + s]
        mask = None
        if s > 1:  # causal among the new tokens, everything before them visible
            mask = torch.ones(s, pos0 + s, dtype=torch.bool, device=x.device).tril(pos0)
        if self._gqa:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 enable_gqa=sh.heads != sh.kv_heads)
        else:
            rep = sh.heads // sh.kv_heads
            out = F.scaled_dot_product_attention(
                q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                attn_mask=mask)
        return F.linear(out.transpose(1, 2).reshape(b, s, h), self.layers[i]["wo"])

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.layers[i]["wgu"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.layers[i]["wd"])

    def logits(self, ids: torch.Tensor, skip_attn: frozenset[int] = frozenset(),
               skip_mlp: frozenset[int] = frozenset(), pos0: int | None = None) -> torch.Tensor:
        """``ids`` [B, s] -> logits [B, s, vocab]; writes K/V at positions pos0..pos0+s
        (default: ``context``)."""
        pos0 = self.context if pos0 is None else pos0
        x = self.embed[ids]
        for i in range(self.n_layers):
            lay = self.layers[i]
            if i not in skip_attn:
                x = x + self._attn(i, self._rms(x, lay["ln1"]), pos0)
            if i not in skip_mlp:
                x = x + self._mlp(i, self._rms(x, lay["ln2"]))
        return F.linear(self._rms(x, self.norm), self.lm_head)

    def step(self, ids: torch.Tensor, skip_attn: frozenset[int] = frozenset(),
             skip_mlp: frozenset[int] = frozenset()) -> torch.Tensor:
        """``ids`` [B, s] -> argmax token ids [B, s]; writes K/V at positions context..+s."""
        return self.logits(ids, skip_attn, skip_mlp).argmax(-1)

    def draft_pass(self, first: torch.Tensor, k: int, skip_attn: frozenset[int],
                   skip_mlp: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The device drafter's pass: ``k`` layer-skip steps of one token per row, each step's
        top-1 token the next step's input, positions advancing; nothing leaves the device.
        ``first`` [B, 1] -> (drafts [B, k], their top-1 probabilities [B, k])."""
        tokens, probs, tok = [], [], first
        for j in range(k):
            logits = self.logits(tok, skip_attn, skip_mlp, self.context + j)
            p, tok = logits.float().softmax(-1).max(-1)
            tokens.append(tok)
            probs.append(p)
        return torch.cat(tokens, 1), torch.cat(probs, 1)

    def host_pass(self, first: torch.Tensor, k: int, skip_attn: frozenset[int],
                  skip_mlp: frozenset[int]) -> list[list[int]]:
        """The host drafter's pass (the ``custom_class`` path): the same ``k`` steps, eager,
        each step's tokens read to the host (a device sync per draft token) and sent back as the
        next step's input."""
        out: list[list[int]] = []
        tok = first
        for j in range(k):
            ids = self.logits(tok, skip_attn, skip_mlp, self.context + j).argmax(-1).tolist()
            out.append([row[0] for row in ids])
            tok = torch.tensor(ids, device=first.device)
        return out


def _sdpa_supports_gqa() -> bool:
    import inspect

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # builtin without a signature: try it
        try:
            q = torch.zeros(1, 2, 1, 8)
            kv = torch.zeros(1, 1, 1, 8)
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            return True
        except TypeError:
            return False


# ------------------------------------------------------------------------------------ timing

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call of ``fn`` (CUDA events on GPU, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def time_graph(fn, device: torch.device, iters: int) -> float | None:
    """Mean seconds per replay of ``fn`` captured as a CUDA graph (None off CUDA)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t = time_fn(graph.replay, device, iters, warmup=2)
    del graph
    return t


# ---------------------------------------------------------------------------------- analysis

def expected_tokens(a: float, k: int) -> float:
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def interp_verify(verify: dict[int, float], k: int) -> float:
    ks = sorted(verify)
    if k in verify:
        return verify[k]
    lo = max([x for x in ks if x < k], default=ks[0])
    hi = min([x for x in ks if x > k], default=ks[-1])
    if lo == hi:
        return verify[lo]
    return verify[lo] + (verify[hi] - verify[lo]) * (k - lo) / (hi - lo)


def project(c_full: float, c_draft: float, verify: dict[int, float], a: float,
            k_max: int = 8) -> tuple[float, int]:
    """Best ``E(a,k) * c_full / (k c_draft + c_verify_k)`` over k = 1..k_max, and its k."""
    best, best_k = 0.0, 1
    for k in range(1, k_max + 1):
        s = expected_tokens(a, k) * c_full / (k * c_draft + interp_verify(verify, k))
        if s > best:
            best, best_k = s, k
    return best, best_k


def linear_costs(full: float, no_attn: float, no_mlp: float, n_layers: int) -> dict[str, float]:
    c_attn = max(full - no_attn, 0.0) / n_layers
    c_mlp = max(full - no_mlp, 0.0) / n_layers
    return {"c_attn": c_attn, "c_mlp": c_mlp,
            "base": max(full - n_layers * (c_attn + c_mlp), 0.0)}


def scaled(lin: dict[str, float], layers: int, skip_attn: int, skip_mlp: int) -> float:
    return lin["base"] + (layers - skip_attn) * lin["c_attn"] + (layers - skip_mlp) * lin["c_mlp"]


# -------------------------------------------------------------------------------------- main

def measure_shape(shape: Shape, batches: list[int], context: int, iters: int,
                  device: torch.device, dtype: torch.dtype, graphs: bool,
                  acceptance: list[float], log=print) -> dict[str, Any]:
    built = shape.build_layers or shape.layers
    skip_attn, skip_mlp, source = skip_sets(shape)
    t0 = time.time()
    model = RandomLlama(shape, built, max(batches), context, device, dtype,
                        max_new=max(VERIFY_KS) + 1)
    log(f"{shape.name}: built {built}/{shape.layers} layers, "
        f"{model.param_bytes() / 2**30:.1f} GiB weights, in {time.time() - t0:.1f} s")
    # skip sets restricted to the built layers (only used when the model is built at full depth)
    full_depth = built == shape.layers
    sa, sm = frozenset(skip_attn), frozenset(skip_mlp)
    all_layers = frozenset(range(built))
    rows = []
    for b in batches:
        one = torch.randint(0, shape.vocab, (b, 1), device=device)
        configs: dict[str, Any] = {
            "full": lambda one=one: model.step(one),
            "no_attn": lambda one=one: model.step(one, skip_attn=all_layers),
            "no_mlp": lambda one=one: model.step(one, skip_mlp=all_layers),
        }
        if full_depth:
            configs["draft"] = lambda one=one: model.step(one, sa, sm)
            for k in PASS_KS:
                configs[f"pass_{k}"] = lambda one=one, k=k: model.draft_pass(one, k, sa, sm)
        for k in VERIFY_KS:
            ids = torch.randint(0, shape.vocab, (b, k + 1), device=device)
            configs[f"verify_{k}"] = lambda ids=ids: model.step(ids)
        row: dict[str, Any] = {"batch": b}
        with torch.inference_mode():
            for mode in ("eager", "graph"):
                if mode == "graph" and not (graphs and device.type == "cuda"):
                    continue
                costs = {}
                for name, fn in configs.items():
                    costs[name] = (time_fn(fn, device, iters) if mode == "eager"
                                   else time_graph(fn, device, iters))
                row[mode] = _derive(costs, built, shape.layers, len(skip_attn), len(skip_mlp),
                                    acceptance)
            if full_depth:
                row["host_pass_s"] = {
                    k: time_fn(lambda one=one, k=k: model.host_pass(one, k, sa, sm), device, iters)
                    for k in PASS_KS}
            if shape.zero_inserted:
                row["free_draft_exactness"] = _free_draft_exactness(model, one, sa, sm)
        rows.append(row)
        e = row["eager"]
        g = row.get("graph")
        log(f"{shape.name} B={b}: full {1e3 * e['full_s']:.2f} ms eager"
            + (f" / {1e3 * g['full_s']:.2f} ms graph" if g else "")
            + f"; draft/full {e['draft_s'] / e['full_s']:.2f} eager"
            + (f" / {g['draft_s'] / g['full_s']:.2f} graph" if g else "")
            + (f"; draft pass per token / full {g['pass_per_token'][4] / g['full_s']:.2f} graph"
               if g and "pass_per_token" in g else "")
            + (f"; free-draft exactness: {row['free_draft_exactness']}"
               if "free_draft_exactness" in row else ""))
    model.free()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": asdict(shape), "built_layers": built, "skip_attention": skip_attn,
            "skip_mlp": skip_mlp, "skip_source": source, "rows": rows}


def _free_draft_exactness(model: RandomLlama, first: torch.Tensor, sa: frozenset[int],
                          sm: frozenset[int]) -> dict[str, Any]:
    """Free drafts are exact: each skipped (inserted, zero-output) layer adds exactly zero, so
    the draft's logits should equal the full model's bit for bit, and its 8 chained greedy
    tokens the full model's. The full model run twice is the control: random weights give
    near-uniform logits, where any rounding difference (a kernel choosing another reduction
    order) flips an argmax."""
    k = max(PASS_KS)
    none: frozenset[int] = frozenset()
    with torch.inference_mode():
        full = model.logits(first, none, none)
        again = model.logits(first, none, none)
        draft = model.logits(first, sa, sm)
        full_tokens, _ = model.draft_pass(first, k, none, none)
        again_tokens, _ = model.draft_pass(first, k, none, none)
        draft_tokens, _ = model.draft_pass(first, k, sa, sm)
    return {
        "logits_equal": bool(torch.equal(draft, full)),
        "logits_max_abs_diff": float((draft.float() - full.float()).abs().max()),
        "control_logits_equal": bool(torch.equal(again, full)),
        "control_logits_max_abs_diff": float((again.float() - full.float()).abs().max()),
        "tokens_equal": bool(torch.equal(draft_tokens, full_tokens)),
        "control_tokens_equal": bool(torch.equal(again_tokens, full_tokens)),
    }


def _derive(costs: dict[str, float], built: int, layers: int, n_sa: int, n_sm: int,
            acceptance: list[float]) -> dict[str, Any]:
    lin = linear_costs(costs["full"], costs["no_attn"], costs["no_mlp"], built)
    full = scaled(lin, layers, 0, 0)
    draft_lin = scaled(lin, layers, n_sa, n_sm)
    draft = costs.get("draft", draft_lin) if built == layers else draft_lin
    scale = full / costs["full"] if costs["full"] > 0 else 1.0
    verify = {k: costs[f"verify_{k}"] * (scale if built != layers else 1.0) for k in VERIFY_KS}
    out = {"full_s": full, "draft_s": draft, "draft_linear_s": draft_lin,
           "measured": costs, "linear": lin, "verify_s": verify,
           "cost_ratio": draft / verify[4], "projected_from_layers": built}
    out["speedup"] = {}
    for a in acceptance:
        s, k = project(full, draft, verify, a)
        out["speedup"][str(a)] = {"speedup": s, "k": k}
    if "pass_1" in costs:  # the draft pass as the device drafter runs it
        passes = {k: costs[f"pass_{k}"] for k in PASS_KS}
        out["pass_s"] = passes
        out["pass_per_token"] = {k: passes[k] / k for k in PASS_KS}
        out["speedup_pass"] = {str(a): project_pass(full, passes, verify, a) for a in acceptance}
    return out


def project_pass(c_full: float, passes: dict[int, float], verify: dict[int, float],
                 a: float) -> dict[str, float]:
    """Best ``E(a,k) * c_full / (c_pass_k + c_verify_k)`` over the measured pass lengths."""
    best = max((expected_tokens(a, k) * c_full / (passes[k] + interp_verify(verify, k)), k)
                for k in passes)
    return {"speedup": best[0], "k": best[1]}


def _cross_ratios(rows: list[dict[str, Any]], acceptance: list[float]) -> None:
    """The plugin today: eager draft steps, verification (and plain decoding) as CUDA graphs."""
    for row in rows:
        if "graph" not in row:
            continue
        e, g = row["eager"], row["graph"]
        mixed = {"cost_ratio": e["draft_s"] / g["verify_s"][4], "speedup": {}}
        for a in acceptance:
            s, k = project(g["full_s"], e["draft_s"], g["verify_s"], a)
            mixed["speedup"][str(a)] = {"speedup": s, "k": k}
        if "host_pass_s" in row:  # the host drafter: eager pass, a sync per draft token
            mixed["speedup_host_pass"] = {
                str(a): project_pass(g["full_s"], row["host_pass_s"], g["verify_s"], a)
                for a in acceptance}
        row["eager_draft_graph_verify"] = mixed


def markdown(result: dict[str, Any]) -> str:
    acc = result["acceptance"]
    lines = [f"# GPU step cost of the draft path ({result['device_name']})", "",
             f"Random-weight models of real shapes, {result['dtype']}, KV cache of "
             f"{result['context']} tokens per sequence, {result['iters']} timed steps per "
             f"number. `r` = draft step / verification of 4 drafts; projected speedup = best "
             f"over k<=8 of E(a,k) * full / (k draft + verify_k) for acceptance a.", ""]
    modes = [("graph", "draft + verify as CUDA graphs"),
             ("eager_draft_graph_verify", "eager draft (plugin today), graph verify"),
             ("eager", "everything eager")]
    for m in result["models"]:
        sh = m["shape"]
        lines += [f"## {sh['name']} ({sh['layers']} layers"
                  + (f", {m['built_layers']} built, costs projected to {sh['layers']}"
                     if m["built_layers"] != sh["layers"] else "")
                  + f"; skip {len(m['skip_attention'])} attention + {len(m['skip_mlp'])} MLP "
                  f"sub-layers, {m['skip_source']})", ""]
        head = ["mode", "B", "full ms", "draft ms", "verify(4) ms", "r"] + [
            f"x @ a={a}" for a in acc]
        lines += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for mode, title in modes:
            for row in m["rows"]:
                d = row.get(mode)
                if d is None:
                    continue
                src = row["graph"] if mode == "eager_draft_graph_verify" else d
                draft = row["eager"]["draft_s"] if mode == "eager_draft_graph_verify" \
                    else d["draft_s"]
                cells = [title, str(row["batch"]), f"{1e3 * src['full_s']:.2f}",
                         f"{1e3 * draft:.2f}", f"{1e3 * src['verify_s'][4]:.2f}",
                         f"{d['cost_ratio']:.2f}"]
                cells += [f"{d['speedup'][str(a)]['speedup']:.2f} (k={d['speedup'][str(a)]['k']})"
                          for a in acc]
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += _pass_table(m, acc)
    return "\n".join(lines)


def _pass_table(m: dict[str, Any], acc: list[float]) -> list[str]:
    """The draft pass of ``k`` = 4 tokens per row: the device drafter's (one CUDA graph, nothing
    leaves the device) and the host drafter's (eager, a device sync per draft token)."""
    rows = [r for r in m["rows"] if "pass_s" in r["eager"]]
    if not rows:
        return []
    mode = "graph" if all("graph" in r for r in rows) else "eager"
    head = ["B", "full ms", "verify(4) ms", "device pass(4) ms", "per token / full",
            "host pass(4) ms", "per token / full"]
    head += [f"x @ a={a} device" for a in acc] + [f"x @ a={a} host" for a in acc]
    captured = ("one captured CUDA graph" if mode == "graph"
                else "eager (no CUDA graphs on this device)")
    lines = [f"Draft pass of 4 tokens per row, {m['shape']['name']}: device drafter = "
             f"{captured}, tokens fed back on the device; host drafter = eager, one "
             f"device-to-host read per draft token; verification and the full step {mode}. "
             "x = best over k in 1, 4, 8 of E(a,k) full / (pass_k + verify_k).", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        g = row[mode]
        full, host = g["full_s"], row["host_pass_s"][4]
        cells = [str(row["batch"]), f"{1e3 * full:.2f}", f"{1e3 * g['verify_s'][4]:.2f}",
                 f"{1e3 * g['pass_s'][4]:.2f}", f"{g['pass_per_token'][4] / full:.2f}",
                 f"{1e3 * host:.2f}", f"{host / 4 / full:.2f}"]
        mixed = {str(a): project_pass(full, row["host_pass_s"], g["verify_s"], a) for a in acc}
        cells += [f"{g['speedup_pass'][str(a)]['speedup']:.2f} (k={g['speedup_pass'][str(a)]['k']})"
                  for a in acc]
        cells += [f"{mixed[str(a)]['speedup']:.2f} (k={mixed[str(a)]['k']})" for a in acc]
        lines.append("| " + " | ".join(cells) + " |")
    exact = [(r["batch"], r["free_draft_exactness"]) for r in m["rows"]
             if "free_draft_exactness" in r]
    if exact:
        lines += ["", "Free drafts against the full model (the full model run twice is the "
                      "control; tokens: 8 chained greedy steps):", "",
                  "| B | logits equal | max abs diff | control equal | control max abs diff "
                  "| tokens equal | control tokens equal |", "|---|---|---|---|---|---|---|"]
        for b, e in exact:
            lines.append(f"| {b} | {e['logits_equal']} | {e['logits_max_abs_diff']:.3g} | "
                         f"{e['control_logits_equal']} | "
                         f"{e['control_logits_max_abs_diff']:.3g} | {e['tokens_equal']} | "
                         f"{e['control_tokens_equal']} |")
    return lines + [""]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_step_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(SHAPES),
                   help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=1024, help="KV tokens per sequence")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--acceptance", default=",".join(str(a) for a in DEFAULT_ACCEPTANCE))
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny shape only (dry run: seconds on CPU)")
    p.add_argument("--time-limit-s", type=float, default=420.0,
                   help="skip remaining models past this (default 7 minutes)")
    p.add_argument("--out", type=Path, help="output folder (default: $OUT, else "
                                            "benchmarks/results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu --tiny for a dry run", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    batches = [int(x) for x in args.batches.split(",")]
    acceptance = [float(x) for x in args.acceptance.split(",")]
    shapes = [TINY] if args.tiny else [SHAPES[n] for n in args.models.split(",")]
    out_dir = args.out or Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    started = time.time()
    result: dict[str, Any] = {
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else "cpu"),
        "torch": torch.__version__, "dtype": args.dtype, "context": args.context,
        "iters": args.iters, "batches": batches, "acceptance": acceptance, "models": [],
        "skipped": [],
    }
    for shape in shapes:
        if time.time() - started > args.time_limit_s:
            result["skipped"].append(shape.name)
            print(f"time limit: skipping {shape.name}", flush=True)
            continue
        try:
            m = measure_shape(shape, batches, args.context, args.iters, device, dtype,
                              not args.no_graphs, acceptance,
                              log=lambda s: print(s, flush=True))
        except torch.OutOfMemoryError as exc:  # the next (smaller) model may still fit
            result["skipped"].append(shape.name)
            print(f"{shape.name}: out of device memory, skipped ({exc})", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        _cross_ratios(m["rows"], acceptance)
        result["models"].append(m)
        _write(result, out_dir, started)
    _write(result, out_dir, started)
    print(markdown(result))
    return 0


def _write(result: dict[str, Any], out_dir: Path, started: float) -> None:
    result["duration_s"] = round(time.time() - started, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_step_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "gpu_step_cost.md").write_text(markdown(result))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["SHAPES", "RandomLlama", "expected_tokens", "linear_costs", "main", "project"]
