"""Teacher-forced matchness of a layer-skip draft, on a Hugging Face ``transformers`` model: the
offline backend of :class:`~vllm_selfspec.layers.matchness.MatchnessScorer`.

Matchness (SWIFT's name) is the fraction of positions of a reference continuation at which the
draft's argmax equals the full model's argmax. Over text the full model generated greedily it
estimates the per-token acceptance ``a`` of greedy speculative decoding with that draft.

How a draft is computed here:

* Skipping a sub-layer is the identity on the residual stream: the wrapped ``self_attn`` /
  ``mlp`` returns zeros, so ``h + 0 == h`` exactly and the sub-layer's pre-norm output is unused
  (the same arithmetic as the plugin's drafter, which does not run the norm at all).
* ``context="target"`` (default) scores the draft the way vLLM's drafter runs it. At a draft
  position ``p`` the drafter's non-skipped attention layers read the **full model's** K/V for
  every verified position ``< p`` and the draft's own K/V at ``p``. One full-model pass records
  every layer's K/V over prompt + continuation (once); a candidate then needs a single batched
  draft forward over the continuation positions only, whose attention combines the recorded K/V
  (strictly earlier positions) with the draft's own key/value (the diagonal). That is exact for
  the first draft of every round; later drafts of a round also see a few draft-written K/V.
* ``context="draft"`` is SWIFT's definition: one draft-mode forward over the whole sequence, so
  every earlier position carries draft K/V too (cheaper to explain, more pessimistic, and 3-4x
  more tokens per candidate).

Device-agnostic PyTorch (runs wherever the model is); imports neither vLLM nor Optuna.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_selfspec.layers.matchness import MatchResult
from vllm_selfspec.layers.skip_set import SkipSet

logger = logging.getLogger("vllm.selfspec.search")

ATTN_IMPL = "selfspec_search"
CONTEXTS = ("target", "draft")


# ------------------------------------------------------------------------------------ skip sets


# --------------------------------------------------------------------------- attention function


class _AttnState(threading.local):
    """What the registered attention function does on the next call (per thread)."""

    def __init__(self) -> None:
        self.mode = "plain"  # "plain" | "record" | "mixed"
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.offdiag_mask: torch.Tensor | None = None  # [B, 1, 1, Tq, Tk] bool, key < query


_STATE = _AttnState()


def _selfspec_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = _STATE
    if state.mode == "record":
        state.kv[module.layer_idx] = (key.detach(), value.detach())
    if state.mode != "mixed":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return _mixed_attention(module, query, key, value, scaling)


def _mixed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    """Draft queries against recorded full-model K/V (strictly earlier positions) + own K/V.

    query ``[B, H, Tq, D]``; key / value ``[B, Hkv, Tq, D]`` (the draft's, at the query
    positions); recorded full-model key / value ``[B, Hkv, Tk, D]``. Returns ``[B, Tq, H, D]``.
    """
    kf, vf = _STATE.kv[module.layer_idx]
    mask = _STATE.offdiag_mask
    assert mask is not None
    b, h, tq, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    if scaling is None:
        scaling = 1.0 / math.sqrt(d)
    dtype = query.dtype
    q = query.float().view(b, hkv, g, tq, d)
    kf32, vf32 = kf.float(), vf.float()
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, kf32) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    own = torch.einsum("bhgqd,bhqd->bhgq", q, key.float()) * scaling
    peak = torch.maximum(scores.amax(dim=-1), own)
    p_off = torch.exp(scores - peak.unsqueeze(-1))
    p_own = torch.exp(own - peak)
    denom = p_off.sum(dim=-1) + p_own
    out = torch.einsum("bhgqk,bhkd->bhgqd", p_off, vf32) + p_own.unsqueeze(-1) * value.float().view(
        b, hkv, 1, tq, d
    )
    out = (out / denom.unsqueeze(-1)).reshape(b, h, tq, d).transpose(1, 2).contiguous()
    return out.to(dtype), None


_registered = False


def _register_attention() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, _selfspec_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
    _registered = True


@contextlib.contextmanager
def _attention_mode(mode: str, **values: Any) -> Iterator[_AttnState]:
    saved = (_STATE.mode, _STATE.kv, _STATE.offdiag_mask)
    _STATE.mode = mode
    for k, v in values.items():
        setattr(_STATE, k, v)
    try:
        yield _STATE
    finally:
        _STATE.mode, _STATE.kv, _STATE.offdiag_mask = saved


# -------------------------------------------------------------------------------- the HF model


def decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """The decoder layers of a ``*ForCausalLM`` (each with ``self_attn`` and ``mlp``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: not a decoder-only LM")
    for i, layer in enumerate(layers):
        for part in ("self_attn", "mlp"):
            if not hasattr(layer, part):
                raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no {part}")
    return layers


class LayerSkipper:
    """Installs skip-aware wrappers around every layer's ``self_attn`` and ``mlp`` (once).

    Inside ``with skipper.skipping(skip):`` a skipped sub-layer returns zeros (the residual passes
    untouched and nothing is computed); outside, the model is the full model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        existing = getattr(model, "_selfspec_skipper", None)
        if existing is not None:
            self.__dict__ = existing.__dict__
            return
        self.model = model
        self.layers = decoder_layers(model)
        self.num_layers = len(self.layers)
        self.skip = SkipSet()
        for index, layer in enumerate(self.layers):
            self._wrap(layer.self_attn, index, attention=True)
            self._wrap(layer.mlp, index, attention=False)
        model._selfspec_skipper = self

    def _wrap(self, module: torch.nn.Module, index: int, *, attention: bool) -> None:
        original = module.forward
        skipper = self

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            skipped = skipper.skip.attention if attention else skipper.skip.mlp
            if index in skipped:
                zeros = torch.zeros_like(hidden_states)
                return (zeros, None) if attention else zeros
            return original(hidden_states, *args, **kwargs)

        module.forward = forward

    @contextlib.contextmanager
    def skipping(self, skip: SkipSet) -> Iterator[None]:
        bad = [i for i in skip.attention + skip.mlp if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer indices {bad} out of range for {self.num_layers} layers")
        saved, self.skip = self.skip, skip
        try:
            yield
        finally:
            self.skip = saved


def load_model(
    model_dir: str | os.PathLike[str], dtype: str = "float32", device: str = "cpu"
) -> tuple[torch.nn.Module, Any]:
    """Load a HF causal LM (with the search's attention function) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _register_attention()
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch_dtype, attn_implementation=ATTN_IMPL
    )
    model.to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    window = getattr(model.config, "sliding_window", None)
    if window and getattr(model.config, "use_sliding_window", True):
        logger.warning(
            "the model has a sliding window (%s); the search's attention ignores it", window
        )
    LayerSkipper(model)
    return model, tokenizer


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


# ---------------------------------------------------------------------------------- references


@dataclass
class Reference:
    """One prompt and the full model's greedy continuation (token ids)."""

    prompt: list[int]
    continuation: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.continuation)


@torch.inference_mode()
def generate_references(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 64,
    batch_size: int = 8,
    max_prompt_tokens: int = 1024,
) -> list[Reference]:
    """Greedy continuations of the full model (stopping at EOS, which is kept)."""
    device = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = next(iter(eos)) if eos else 0
    encoded = []
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(ids) > max_prompt_tokens:
            ids = ids[-max_prompt_tokens:]
        encoded.append(list(ids))
    refs: list[Reference] = []
    skipper = LayerSkipper(model)
    with skipper.skipping(SkipSet()), _attention_mode("plain"):
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start : start + batch_size]
            width = max(len(x) for x in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, x in enumerate(batch):  # left padding
                ids[row, width - len(x) :] = torch.tensor(x)
                mask[row, width - len(x) :] = 1
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=sorted(eos) or None,
            )
            for row, x in enumerate(batch):
                cont: list[int] = []
                for t in out[row, width:].tolist():
                    cont.append(int(t))
                    if t in eos:
                        break
                refs.append(Reference(prompt=x, continuation=cont))
    return refs


# ------------------------------------------------------------------------------------- scoring


@dataclass
class _Chunk:
    rows: list[int]  # reference indices
    full_ids: torch.Tensor  # [B, Tk] right padded
    q_ids: torch.Tensor  # [B, Tq] inputs at the query positions, right padded
    q_pos: torch.Tensor  # [B, Tq] positions of the query inputs
    q_valid: torch.Tensor  # [B, Tq] bool
    targets: torch.Tensor  # [B, Tq] full-model argmax at the query positions
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    offdiag_mask: torch.Tensor | None = None
    # full-model input of each decoder layer: at the query positions (target context) or at
    # every position (draft context); a draft is identical up to its first skipped sub-layer
    layer_inputs: list[torch.Tensor] = field(default_factory=list)


class HFMatchnessScorer:
    """The offline :class:`~vllm_selfspec.layers.matchness.MatchnessScorer`: teacher-forced
    matchness of skip sets over fixed references, on a Hugging Face model.

    Construction runs the full model once over every reference (prompt + continuation) and keeps
    its argmax at each continuation position as the target (and, for ``context="target"``, every
    layer's K/V). :meth:`score` then costs one draft forward per candidate.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        references: Sequence[Reference],
        context: str = "target",
        max_batch_tokens: int = 4096,
    ) -> None:
        if context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS}, got {context!r}")
        refs = [r for r in references if r.continuation and r.prompt]
        if not refs:
            raise ValueError("no reference continuations to score against")
        self.model = model
        self.references = list(refs)
        self.context = context
        self.skipper = LayerSkipper(model)
        self.num_layers = self.skipper.num_layers
        self.device = next(model.parameters()).device
        self.positions = sum(len(r.continuation) for r in self.references)
        self.reference_disagreements = 0  # generated token != full-model argmax (numerics)
        self._fast = _has_plain_decoder_loop(model)
        self._chunks = self._build_chunks(max_batch_tokens)

    # ---- construction ------------------------------------------------------------------------
    def _build_chunks(self, max_batch_tokens: int) -> list[_Chunk]:
        order = sorted(range(len(self.references)), key=lambda i: self.references[i].length)
        groups: list[list[int]] = []
        for i in order:
            if groups:
                rows = groups[-1] + [i]
                width = max(self.references[j].length for j in rows)
                if width * len(rows) <= max_batch_tokens:
                    groups[-1] = rows
                    continue
            groups.append([i])
        return [self._record(rows) for rows in groups]

    @torch.inference_mode()
    def _record(self, rows: list[int]) -> _Chunk:
        refs = [self.references[i] for i in rows]
        pad = 0
        tk = max(r.length for r in refs)
        tq = max(len(r.continuation) for r in refs)
        b = len(refs)
        full_ids = torch.full((b, tk), pad, dtype=torch.long)
        q_ids = torch.full((b, tq), pad, dtype=torch.long)
        q_pos = torch.zeros((b, tq), dtype=torch.long)
        q_valid = torch.zeros((b, tq), dtype=torch.bool)
        for row, r in enumerate(refs):
            seq = r.prompt + r.continuation
            full_ids[row, : len(seq)] = torch.tensor(seq)
            n, p0 = len(r.continuation), len(r.prompt) - 1
            # inputs at positions p0 .. p0+n-1 predict the n continuation tokens
            q_ids[row, :n] = torch.tensor(seq[p0 : p0 + n])
            q_pos[row] = p0 + torch.arange(tq)
            q_valid[row, :n] = True
        dev = self.device
        chunk = _Chunk(rows, full_ids.to(dev), q_ids.to(dev), q_pos.to(dev), q_valid.to(dev),
                       targets=torch.empty(0))
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        mode = "record" if self.context == "target" else "plain"
        idx = chunk.q_pos.clamp(max=tk - 1)
        inputs: list[torch.Tensor] = []

        def keep_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden_in = args[0] if args else kwargs["hidden_states"]
            if self.context == "target":
                hidden_in = _gather(hidden_in, idx)
            inputs.append(hidden_in.detach())

        hooks = []
        if self._fast:
            hooks = [layer.register_forward_pre_hook(keep_input, with_kwargs=True)
                     for layer in self.skipper.layers]
        try:
            with self.skipper.skipping(SkipSet()), _attention_mode(mode, kv=kv):
                hidden = self.model.model(input_ids=chunk.full_ids).last_hidden_state
        finally:
            for hook in hooks:
                hook.remove()
        chunk.layer_inputs = inputs
        picked = _gather(hidden, idx)
        chunk.targets = self._argmax(picked)
        for row, r in enumerate(refs):
            n = len(r.continuation)
            gen = torch.tensor(r.continuation, device=dev)
            self.reference_disagreements += int((chunk.targets[row, :n] != gen).sum())
        if self.context == "target":
            chunk.kv = kv
            key_pos = torch.arange(tk, device=dev)
            chunk.offdiag_mask = (key_pos.view(1, 1, -1) < chunk.q_pos.unsqueeze(-1)).view(
                b, 1, 1, tq, tk
            )
        return chunk

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden)
        return logits.argmax(dim=-1)

    # ---- scoring -----------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, skip: SkipSet, keep_hits: bool = False) -> MatchResult:
        matches = 0
        hits: list[list[bool]] = [[] for _ in self.references]
        with self.skipper.skipping(skip):
            for chunk in self._chunks:
                pred = self._draft_argmax(chunk)
                ok = (pred == chunk.targets) & chunk.q_valid
                matches += int(ok.sum())
                if keep_hits:
                    for row, ref_index in enumerate(chunk.rows):
                        n = len(self.references[ref_index].continuation)
                        hits[ref_index] = ok[row, :n].tolist()
        return MatchResult(matches / self.positions, matches, self.positions,
                           hits if keep_hits else [])

    def _draft_argmax(self, chunk: _Chunk) -> torch.Tensor:
        skip = self.skipper.skip
        target = self.context == "target"
        start = min(skip.attention + skip.mlp, default=self.num_layers)
        if self._fast and start == self.num_layers:
            return chunk.targets  # nothing skipped: the draft is the full model
        mode = ("mixed", dict(kv=chunk.kv, offdiag_mask=chunk.offdiag_mask)) if target else (
            "plain", {})
        with _attention_mode(mode[0], **mode[1]):
            if self._fast:
                if target:
                    positions = chunk.q_pos
                else:
                    width = chunk.full_ids.shape[1]
                    positions = torch.arange(width, device=self.device).unsqueeze(0).expand(
                        chunk.full_ids.shape[0], -1)
                hidden = _run_layers(self.model, chunk.layer_inputs[start], positions, start)
            elif target:
                hidden = self.model.model(
                    input_ids=chunk.q_ids, position_ids=chunk.q_pos
                ).last_hidden_state
            else:
                hidden = self.model.model(input_ids=chunk.full_ids).last_hidden_state
        if not target:
            tk = chunk.full_ids.shape[1]
            hidden = _gather(hidden, chunk.q_pos.clamp(max=tk - 1))
        return self._argmax(hidden)


_PLAIN_DECODERS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


def _has_plain_decoder_loop(model: torch.nn.Module) -> bool:
    """Whether ``model.model`` is embed -> rotary -> layers -> norm (we may run a layer slice)."""
    inner = getattr(model, "model", None)
    return type(inner).__name__ in _PLAIN_DECODERS and all(
        hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")
    )


def _run_layers(
    model: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor, start: int
) -> torch.Tensor:
    """Decoder layers ``start..`` and the final norm (no mask: causal or our own attention)."""
    inner = model.model
    position_embeddings = inner.rotary_emb(hidden, position_ids=positions)
    for layer in inner.layers[start:]:
        out = layer(hidden, attention_mask=None, position_ids=positions,
                    position_embeddings=position_embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    return inner.norm(hidden)


def _gather(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``hidden[b, index[b, i]]`` -> ``[B, Tq, H]``."""
    return torch.gather(hidden, 1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def simulate_chain_acceptance(hits: Sequence[Sequence[bool]], k: int) -> dict[str, float]:
    """Replay fixed-length-``k`` drafting along the references using per-position hits.

    Each round starts at the first unverified position, accepts the run of consecutive hits (at
    most ``k``) and then moves past the accepted drafts plus the one token verification adds.
    Treats every draft of a round like a first draft (target context). Returns vLLM-style
    ``acceptance_rate`` (accepted / drafted), per-token acceptance (accepted / (accepted +
    rejections)) and the mean accepted length (1 + accepted / rounds).
    """
    accepted = drafted = rounds = rejections = 0
    for row in hits:
        n = len(row)
        p = 0
        while p < n:
            budget = min(k, n - p)
            run = 0
            while run < budget and row[p + run]:
                run += 1
            rounds += 1
            drafted += budget
            accepted += run
            if run < budget:
                rejections += 1
            p += run + 1
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_token_acceptance": (
            accepted / (accepted + rejections) if accepted + rejections else 0.0
        ),
        "mean_accepted_length": 1 + accepted / rounds if rounds else 1.0,
        "rounds": float(rounds),
    }
