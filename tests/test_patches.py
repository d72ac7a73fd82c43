"""The plugin's patches to vLLM: entry point, version check, idempotence, no effect elsewhere."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

from vllm_selfspec.plugin import engine_markers, patches
from vllm_selfspec.plugin.patches import cpu_sampler, model_runner


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "vllm_selfspec:register" for ep in eps), list(eps)


def test_vllm_loads_the_plugin_without_any_import():
    # A fresh interpreter that never imports vllm_selfspec: vLLM's plugin loader patches.
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "print(getattr(EngineArgs.create_speculative_config, '_vllm_selfspec_patched', False))\n"
    )
    assert _fresh_python(code)[-1:] == ["True"]


def _fresh_python(code: str) -> list[str]:
    """The stdout lines of ``code`` run in a fresh interpreter (which must succeed)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.32.0", True),
        ("0.33.1", True),
        ("0.32.0.dev3", True),
        ("0.31.2", False),
        ("0.34.0", False),
        ("1.0.0", False),
    ],
)
def test_version_check(version, ok):
    problem = patches.check_vllm_version(version)
    assert (problem is None) == ok
    if not ok:
        assert version in problem and ">=0.32" in problem


def test_patches_are_idempotent():
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_patches()
    first = (EngineArgs.create_speculative_config, VllmConfig.use_v2_model_runner,
             VllmConfig._get_v2_model_runner_unsupported_features)
    patches._applied = False  # force a second installation attempt
    patches.apply_patches()
    assert (EngineArgs.create_speculative_config, VllmConfig.use_v2_model_runner,
            VllmConfig._get_v2_model_runner_unsupported_features) == first
    # never wrapped twice
    assert not getattr(
        EngineArgs.create_speculative_config.__wrapped__, "_vllm_selfspec_patched", False
    )


class _FakeSpec:
    def __init__(self, method, model, k):
        self.method, self.model, self.num_speculative_tokens = method, model, k


class _FakeVllmConfig:
    def __init__(self, spec):
        self.speculative_config = spec


@pytest.mark.skipif(not cpu_sampler.cpu_expand_bug_present(), reason="only on vLLM's CPU build")
def test_cpu_expand_workaround_fixes_float_expansion():
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what a CPU worker does at start
    patches.apply_patches()
    temperatures = torch.tensor([0.7, 0.7, 1.3, 1.3, 1.3], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6, 6, 9], dtype=torch.int32)
    counts = torch.diff(cu.long(), prepend=torch.zeros(1, dtype=torch.long))
    expected = torch.repeat_interleave(temperatures, counts)
    fixed = rs.expand_batch_to_tokens(temperatures, cu, 9)
    assert torch.equal(fixed, expected)
    # The unpatched vLLM function returns garbage for float32: the workaround is needed.
    broken = rs.expand_batch_to_tokens.__wrapped__(temperatures, cu, 9)
    assert not torch.equal(broken, expected)
    # replace_from/replace_to and int64 inputs keep vLLM's semantics
    top_k = torch.tensor([0, 5, 0, 7, 9], dtype=torch.int32)
    got = rs.expand_batch_to_tokens(top_k, cu, 9, replace_from=0, replace_to=576)
    assert got.tolist() == [576, 576, 5, 5, 5, 576, 9, 9, 9]
    as_int64 = rs.expand_batch_to_tokens(top_k.long(), cu, 9, replace_from=0, replace_to=576)
    assert as_int64.tolist() == got.tolist()


def test_selfspec_drafter_only_for_selfspec_draft_model_engines():
    def config(method, settings):
        cfg = _FakeVllmConfig(_FakeSpec(method, "some/model", 4))
        cfg.additional_config = None if settings is None else {"selfspec": settings}
        return cfg

    assert engine_markers.is_selfspec_engine(config("draft_model", {"drafts": "hybrid"}))
    # a user's own draft-model engine keeps vLLM's proposer
    assert not engine_markers.is_selfspec_engine(config("draft_model", None))
    assert not engine_markers.is_selfspec_engine(config("custom_class", {"drafts": "hybrid"}))
    assert not engine_markers.is_selfspec_engine(_FakeVllmConfig(None))


def test_runner_patch_waits_for_the_runner_module():
    # A fresh interpreter: loading the plugin imports none of vLLM's worker; the runner is
    # patched once its module is imported.
    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print('vllm.v1.worker.gpu_model_runner' in sys.modules)\n"
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "print(getattr(GPUModelRunner.__init__, '_vllm_selfspec_patched', False))\n"
    )
    assert _fresh_python(code)[-2:] == ["False", "True"]


def test_steps_without_drafts_skip_the_rejection_sampler():
    """Patch 9 on a stand-in runner: metadata with no drafts is dropped (vLLM's plain sampling
    path), metadata with drafts reaches vLLM's ``_sample`` unchanged; wrapping twice is a no-op."""
    from types import SimpleNamespace

    seen: list[object] = []

    class Runner:
        def _sample(self, logits, spec_decode_metadata):
            seen.append(spec_decode_metadata)
            return logits

    runner = Runner()
    plain_steps: list[int] = []
    model_runner.patch_runner_sample_without_drafts(runner, lambda: plain_steps.append(1))
    model_runner.patch_runner_sample_without_drafts(runner, lambda: plain_steps.append(1))
    no_drafts = SimpleNamespace(max_spec_len=0)
    drafts = SimpleNamespace(max_spec_len=3)
    assert runner._sample("logits", no_drafts) == "logits"
    runner._sample("logits", drafts)
    runner._sample("logits", None)
    assert seen == [None, drafts, None]
    assert plain_steps == [1]


def test_rejected_counts_from_sampled_tokens():
    """The rejected drafts per row, counted from the sampled tokens as vLLM's
    ``prepare_inputs_padded`` counts them: ``drafted + 1 - valid`` where a row had drafts."""
    import torch

    sampled = torch.tensor(
        [
            [5, 6, -1, -1],  # 3 drafted, 2 valid (1 accepted + 1 sampled): 2 rejected
            [7, 8, 9, 10],  # 3 drafted, all accepted: 0 rejected
            [11, -1, -1, -1],  # 3 drafted, none accepted: 3 rejected
            [12, -1, -1, -1],  # no drafts (a prefill or drafting off): 0
        ]
    )
    rejected = model_runner.rejected_from_sampled(sampled, [3, 3, 3, 0])
    assert rejected.tolist() == [2, 0, 3, 0]
    as_lists = [[5, 6], [7, 8, 9, 10], [11], [12]]
    assert model_runner.rejected_from_sampled(as_lists, [3, 3, 3, 0]).tolist() == [2, 0, 3, 0]


def test_preparation_skipped_when_the_plan_runs_no_pass():
    """The propose wrapper on a stand-in runner: the drafter plans first (with the rejected
    counts of a step that verified drafts, ``None`` for one that verified none); its drafts are
    returned without vLLM's method when it plans no pass, vLLM's method runs when it plans one,
    and a runner with a host-copy event (CUDA) always delegates."""
    from types import SimpleNamespace

    import torch

    delegated: list[int] = []

    class Runner:
        valid_sampled_token_count_event = None

        def propose_draft_token_ids(self, scheduler_output, sampled, *rest):
            delegated.append(1)
            return "vllm drafts"

    plans: list[object] = []
    planned_pass = [False]

    def plan(k_limit, batch_size, num_rejected):
        plans.append((k_limit, batch_size, None if num_rejected is None else num_rejected.tolist()))
        return None if planned_pass[0] else "no pass"

    seen: list[object] = []
    runner = Runner()
    model_runner.patch_runner_propose_without_drafts(runner, plan, seen.append)
    sched = SimpleNamespace(num_spec_tokens_to_schedule=4)
    cad = SimpleNamespace(batch_size=lambda: 2)
    sampled = torch.tensor([[1, 2, -1], [3, -1, -1]])
    verified = SimpleNamespace(num_draft_tokens=[2, 2])

    def call(metadata):
        return runner.propose_draft_token_ids(sched, sampled, None, None, None, None, metadata, cad,
                                              None)

    assert call(verified) == "no pass" and not delegated
    assert plans[-1] == (4, 2, [1, 2])
    assert call(None) == "no pass" and plans[-1] == (4, 2, None)
    assert call(SimpleNamespace(num_draft_tokens=[0, 0])) == "no pass" and plans[-1][2] is None
    planned_pass[0] = True
    assert call(verified) == "vllm drafts" and delegated == [1]
    assert len(seen) == 4
    runner.valid_sampled_token_count_event = object()
    calls = len(plans)
    assert call(verified) == "vllm drafts" and len(plans) == calls


# --- patch 11: recovered-token noise on CPU --------------------------------------------------


def _recovered_inputs(num_draft_tokens: list[int], vocab: int, seed: int = 0):
    """Inputs of ``sample_recovered_tokens``: random target / draft distributions per draft
    token, one draft token id each."""
    g = torch.Generator().manual_seed(seed)
    n = sum(num_draft_tokens)
    cu = torch.tensor(num_draft_tokens, dtype=torch.int32).cumsum(0).to(torch.int32)
    target = torch.softmax(torch.randn(n, vocab, generator=g), -1)
    draft = torch.softmax(torch.randn(n, vocab, generator=g), -1)
    drafted = torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32)
    return cu, drafted, target, draft


def _patched_recovered_sampler():
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("patch 11 is installed on vLLM's CPU build only")
    current_platform.register_triton_kernel_overrides()  # what a CPU worker does at start
    cpu_sampler._patch_cpu_recovered_token_noise()
    return rs


def test_recovered_noise_seeded_requests_draw_as_vllm_does():
    """Patch 11: requests with their own generator draw ``exponential_`` from it, as vLLM does,
    so with every drafting request seeded the patched and vLLM's functions give the same tokens;
    a seeded request without drafts leaves its generator untouched."""
    from types import SimpleNamespace

    rs = _patched_recovered_sampler()
    num_draft = [2, 0, 3]
    cu, drafted, target, draft = _recovered_inputs(num_draft, vocab=64)

    def run(fn, scoped: bool):
        gens = {i: torch.Generator().manual_seed(10 + i) for i in range(3)}
        meta = SimpleNamespace(generators=gens)
        args = (3, num_draft, cu, drafted, draft, target, meta, torch.device("cpu"))
        if scoped:
            with cpu_sampler.cheap_recovered_token_noise():
                out = fn(*args)
        else:
            out = fn(*args)
        return out, gens

    ours, gens = run(rs.sample_recovered_tokens, scoped=True)
    vllms, _ = run(rs.sample_recovered_tokens.__wrapped__, scoped=False)
    assert torch.equal(ours, vllms)
    fresh = torch.Generator().manual_seed(11)
    assert torch.equal(gens[1].get_state(), fresh.get_state())  # no drafts: no draws


def test_recovered_noise_outside_selfspec_runners_is_vllms():
    """Outside the scope that selfspec runners enter, the wrapper delegates to vLLM: same global
    RNG draws, same tokens."""
    from types import SimpleNamespace

    rs = _patched_recovered_sampler()
    num_draft = [1, 2, 0, 1]
    cu, drafted, target, draft = _recovered_inputs(num_draft, vocab=128, seed=1)
    meta = SimpleNamespace(generators={})
    args = (2, num_draft, cu, drafted, draft, target, meta, torch.device("cpu"))
    torch.manual_seed(3)
    wrapped = rs.sample_recovered_tokens(*args)
    after_wrapped = torch.rand(1)
    torch.manual_seed(3)
    original = rs.sample_recovered_tokens.__wrapped__(*args)
    after_original = torch.rand(1)
    assert torch.equal(wrapped, original)
    assert torch.equal(after_wrapped, after_original)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_recovered_noise_samples_the_residual_distribution(with_draft_probs):
    """Patch 11's tokens follow vLLM's recovered distribution: ``max(p - q, 0)`` normalised with
    draft probabilities, ``p`` without the draft token otherwise (chi-square, 24,000 draws).
    Negative control: the same draws against a uniform distribution on that support are
    rejected."""
    from types import SimpleNamespace

    from scipy.stats import chisquare

    rs = _patched_recovered_sampler()
    vocab, rows = 6, 400
    p = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    q = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.10, 0.05])
    num_draft = [1] * rows
    cu = torch.arange(1, rows + 1, dtype=torch.int32)
    drafted = torch.full((rows,), 1, dtype=torch.int32)
    target = p.expand(rows, vocab).contiguous()
    draft = q.expand(rows, vocab).contiguous() if with_draft_probs else None
    meta = SimpleNamespace(generators={})
    counts = torch.zeros(vocab)
    torch.manual_seed(0)
    with cpu_sampler.cheap_recovered_token_noise():
        for _ in range(60):
            out = rs.sample_recovered_tokens(
                1, num_draft, cu, drafted, draft, target, meta, torch.device("cpu")
            )
            counts += torch.bincount(out.long(), minlength=vocab)
    if with_draft_probs:
        residual = (p - q).clamp(min=0)
    else:  # vLLM's kernel without draft probabilities: the target without the draft token
        residual = p.clone().index_fill_(0, torch.tensor([1]), 0)
    residual = residual / residual.sum()
    support = residual > 0
    assert counts[~support].sum() == 0
    total = counts.sum().item()
    assert chisquare(counts[support].numpy(), (residual[support] * total).numpy()).pvalue > 1e-4
    control = torch.full((int(support.sum()),), total / int(support.sum()))  # uniform
    assert chisquare(counts[support].numpy(), control.numpy()).pvalue < 1e-6


def test_recovered_noise_rows_without_drafts_draw_nothing():
    """Only requests with drafts get noise: the rows of the others are never filled (vLLM's
    kernel does not read them), and rows with drafts hold finite, non-negative ``1 / q``."""
    inv_q = cpu_sampler.recovered_token_inverse_noise(
        [0, 3, 0, 1], {}, 32, torch.float32, torch.device("cpu")
    )
    assert inv_q.shape == (4, 32)
    for row in (1, 3):
        assert torch.isfinite(inv_q[row]).all() and (inv_q[row] >= 0).all()
    torch.manual_seed(5)
    cpu_sampler.recovered_token_inverse_noise([0, 0], {}, 32, torch.float32, torch.device("cpu"))
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(1))
