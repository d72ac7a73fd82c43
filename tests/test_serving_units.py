"""Serving pieces that need no running engine: the plugin's metrics logger, per-request overrides
through ``vllm_xargs``, and the CPU top-k patch (patch 6)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_selfspec.plugin import patches
from vllm_selfspec.plugin.patches import front_end

NUM_LAYERS = 6


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("errors-llama", arch="llama", num_layers=NUM_LAYERS)


def _vllm_config(model_dir, speculative_config):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_patches()
    args = EngineArgs(
        model=str(model_dir),
        speculative_config=speculative_config,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=1 << 26,
        served_model_name=["unit"],
    )
    return args.create_engine_config()


def _sample(name, **labels):
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"model_name": "unit", "engine": "0", **labels})


def _stats(running, drafts=0, draft_tokens=0, decoding=0):
    spec = None
    if drafts:
        spec = SimpleNamespace(num_drafts=drafts, num_draft_tokens=draft_tokens)
    scheduler = SimpleNamespace(num_running_reqs=running, spec_decoding_stats=spec)
    iteration = SimpleNamespace(inter_token_latencies_iter=[0.01] * decoding)
    return scheduler, iteration


def test_stat_logger_only_for_selfspec_engines(model_dir):
    from vllm.v1.metrics.loggers import StatLoggerManager

    from vllm_selfspec.plugin.metrics import SelfSpecStatLogger

    plain = _vllm_config(model_dir, None)
    manager = StatLoggerManager(plain, engine_idxs=[0], enable_default_loggers=False)
    assert not any(isinstance(s, SelfSpecStatLogger) for s in manager.stat_loggers)
    assert _sample("vllm:selfspec_mean_draft_length") is None

    spec = _vllm_config(model_dir, {"method": "selfspec", "skip_attention": [2],
                                    "num_speculative_tokens": 3})
    manager = StatLoggerManager(spec, engine_idxs=[0], enable_default_loggers=False)
    ours = [s for s in manager.stat_loggers if isinstance(s, SelfSpecStatLogger)]
    assert len(ours) == 1
    # the wrapper is installed once, whatever the number of calls
    front_end.install_metrics()
    front_end.install_metrics()
    assert getattr(StatLoggerManager.__init__, "_vllm_selfspec_patched", False)
    assert not getattr(StatLoggerManager.__init__.__wrapped__, "_vllm_selfspec_patched", False)

    # step 1: 3 requests decode, 2 of them with drafts (3 + 1 tokens)
    ours[0].record(*_stats(running=3, drafts=2, draft_tokens=4, decoding=3), engine_idx=0)
    assert _sample("vllm:selfspec_mean_draft_length") == pytest.approx(2.0)
    assert _sample("vllm:selfspec_requests_drafting_off") == 1
    # step 2: a prefill-only step (no decode) leaves the counters alone
    ours[0].record(*_stats(running=4, decoding=0), engine_idx=0)
    assert _sample("vllm:selfspec_requests_drafting_off") == 0
    # step 3: 4 decode, 1 with 3 drafts; mean over the window = (4 + 3) / 3
    ours[0].record(*_stats(running=4, drafts=1, draft_tokens=3, decoding=4), engine_idx=0)
    assert _sample("vllm:selfspec_mean_draft_length") == pytest.approx(7 / 3)
    assert _sample("vllm:selfspec_requests_drafting_off") == 3
    assert _sample("vllm:selfspec_decode_request_steps_total") == 7
    assert _sample("vllm:selfspec_request_steps_drafting_off_total") == 4
    # last step of the last requests: nothing running any more -> gauge back to 0
    ours[0].record(*_stats(running=0, decoding=2), engine_idx=0)
    assert _sample("vllm:selfspec_requests_drafting_off") == 0
    # a new engine's loggers replace the old metrics (no duplicate registration)
    StatLoggerManager(spec, engine_idxs=[0], enable_default_loggers=False)
    assert _sample("vllm:selfspec_decode_request_steps_total") == 0


def _totals(lookup, layer_skip):
    keys = ("request_steps", "draft_tokens", "accepted_tokens")
    return {"lookup": dict(zip(keys, lookup, strict=True)),
            "layer_skip": dict(zip(keys, layer_skip, strict=True))}


def test_per_source_counters_follow_the_pulled_totals(model_dir, caplog):
    """The per-source counters advance by what the workers' totals grew between pulls; a TP
    rank other than the first answers None; the log line gives each source's share since the
    last line."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    from vllm_selfspec.plugin.metrics import selfspec_stat_logger

    spec = _vllm_config(model_dir, {"method": "selfspec", "skip_attention": [2],
                                    "num_speculative_tokens": 3})
    manager = StatLoggerManager(spec, engine_idxs=[0], enable_default_loggers=False)
    ours = selfspec_stat_logger(manager)
    assert ours is not None
    name = "vllm:selfspec_num_draft_tokens_total"
    assert _sample(name, source="lookup") == 0 and _sample(name, source="layer_skip") == 0
    ours.observe_source_totals([(0, _totals((2, 6, 4), (1, 3, 3))), None])
    ours.observe_source_totals([(0, _totals((5, 15, 9), (1, 3, 3))), None])
    assert _sample(name, source="lookup") == 15
    assert _sample(name, source="layer_skip") == 3
    assert _sample("vllm:selfspec_num_accepted_tokens_total", source="lookup") == 9
    assert _sample("vllm:selfspec_num_drafts_total", source="lookup") == 5
    assert _sample("vllm:selfspec_num_drafts_total", source="layer_skip") == 1
    # vLLM's "vllm" logger may not propagate to the root logger where caplog listens (that
    # depends on what configured logging first): listen on our logger itself
    records: list[logging.LogRecord] = []
    listener = logging.Handler(level=logging.INFO)
    listener.emit = records.append
    metrics_logger = logging.getLogger("vllm.selfspec.metrics")
    metrics_logger.addHandler(listener)
    try:
        with caplog.at_level("INFO", logger="vllm.selfspec.metrics"):
            ours.log()
            ours.observe_source_totals([(0, _totals((6, 18, 9), (1, 3, 3)))])
            ours.log()
            ours.log()  # nothing new: no line
    finally:
        metrics_logger.removeHandler(listener)
    lines = [r.getMessage() for r in records if "by source" in r.getMessage()]
    assert lines == [
        "selfspec drafts by source (engine 0): lookup 15 draft tokens in 5 drafts, 0.60 "
        "accepted; layer_skip 3 draft tokens in 1 drafts, 1.00 accepted",
        "selfspec drafts by source (engine 0): lookup 3 draft tokens in 1 drafts, 0.00 accepted",
    ]
    # the pull wrappers of the front ends are installed once
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    front_end.install_metrics()
    for cls, attr in ((AsyncLLM, "do_log_stats"), (LLMEngine, "do_log_stats"),
                      (LLMEngine, "get_metrics")):
        wrapper = getattr(cls, attr)
        assert getattr(wrapper, "_vllm_selfspec_patched", False), (cls, attr)
        assert not getattr(wrapper.__wrapped__, "_vllm_selfspec_patched", False), (cls, attr)


def test_per_source_counters_of_data_parallel_engines(model_dir):
    """With data parallelism each engine's first TP rank answers with its own DP rank: its totals
    advance the counters labelled with that engine only, and each engine's increments are
    computed against its own previous pull."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    from vllm_selfspec.plugin.metrics import selfspec_stat_logger

    spec = _vllm_config(model_dir, {"method": "selfspec", "skip_attention": [2],
                                    "num_speculative_tokens": 3})
    manager = StatLoggerManager(spec, engine_idxs=[0, 1], enable_default_loggers=False)
    ours = selfspec_stat_logger(manager)
    assert ours is not None and ours.engine_indexes == [0, 1]
    name = "vllm:selfspec_num_draft_tokens_total"

    def sample(engine, source):
        return _sample(name, engine=str(engine), source=source)

    ours.observe_source_totals([(0, _totals((2, 6, 4), (1, 3, 3))), None,
                                (1, _totals((1, 4, 4), (0, 0, 0))), None])
    assert (sample(0, "lookup"), sample(0, "layer_skip")) == (6, 3)
    assert (sample(1, "lookup"), sample(1, "layer_skip")) == (4, 0)
    # only engine 1 drafted since: engine 0's counters stay, engine 1's grow by the difference
    ours.observe_source_totals([(1, _totals((3, 10, 7), (2, 8, 5))), None,
                                (0, _totals((2, 6, 4), (1, 3, 3))), None])
    assert (sample(0, "lookup"), sample(0, "layer_skip")) == (6, 3)
    assert (sample(1, "lookup"), sample(1, "layer_skip")) == (10, 8)


def test_flat_vllm_xargs_overrides():
    from vllm_selfspec.control.controller import flat_overrides, validate_request_overrides

    assert flat_overrides({}) is None
    assert flat_overrides({"other": 1}) is None
    got = flat_overrides({"selfspec_num_speculative_tokens": 0, "x": 1})
    assert validate_request_overrides(got, k_max=4) == {"num_speculative_tokens": 0}
    # JSON true arrives as 1 through vllm_xargs' str | int | float values
    got = flat_overrides({"selfspec_adaptive": 1, "selfspec_num_speculative_tokens": 2.0})
    assert validate_request_overrides(got, k_max=4) == {"adaptive": True,
                                                        "num_speculative_tokens": 2}
    got = flat_overrides({"selfspec_adaptive": "false",
                           "selfspec_draft_confidence_threshold": 0.25})
    assert validate_request_overrides(got, k_max=4) == {"adaptive": False,
                                                        "draft_confidence_threshold": 0.25}
    with pytest.raises(ValueError, match="unknown selfspec override key 'bogus'"):
        validate_request_overrides(flat_overrides({"selfspec_bogus": 1}), k_max=4)


@pytest.fixture(scope="module")
def input_processors(model_dir):
    """vLLM's front-end input processors of a selfspec engine (k_max 3) and of a plain one."""
    from vllm.v1.engine.input_processor import InputProcessor

    spec = _vllm_config(model_dir, {"method": "selfspec", "skip_attention": [2],
                                    "num_speculative_tokens": 3})
    return InputProcessor(spec), InputProcessor(_vllm_config(model_dir, None))


def _process(processor, extra_args):
    prompt = {"type": "token", "prompt_token_ids": [1, 2, 3]}
    return processor.process_inputs("r", prompt, _params(extra_args), supported_tasks=("generate",))


# (extra_args, the key the error names, words of its reason)
BAD_OVERRIDES = [
    ({"selfspec": {"num_speculative_tokens": 4}}, "selfspec.num_speculative_tokens",
     "exceeds the configured maximum of 3"),
    ({"selfspec_num_speculative_tokens": -3}, "selfspec_num_speculative_tokens",
     "must be an int >= 0"),
    ({"selfspec_num_speculative_tokens": 2.5}, "selfspec_num_speculative_tokens",
     "must be an int >= 0"),
    ({"selfspec_bogus": 1}, "selfspec_bogus", "unknown selfspec override key 'bogus'"),
    ({"selfspec_adaptive": "maybe"}, "selfspec_adaptive", "must be a bool"),
    ({"selfspec": {"adaptive": 1}}, "selfspec.adaptive", "must be a bool"),
    ({"selfspec": {"draft_confidence_threshold": -0.1}}, "selfspec.draft_confidence_threshold",
     "must be a number in [0, 1]"),
    ({"selfspec": "k=2"}, "selfspec", "must be a dict"),
    ({"selfspec": {}, "selfspec_adaptive": 0}, "selfspec", "not both"),
]
GOOD_OVERRIDES = [
    None,
    {"other": 1},
    {"selfspec": {"num_speculative_tokens": 3, "adaptive": False}},
    {"selfspec": {"num_speculative_tokens": 0, "draft_confidence_threshold": 1}},
    {"selfspec_num_speculative_tokens": 2.0, "selfspec_adaptive": "false"},
    {"selfspec_adaptive": 1, "selfspec_draft_confidence_threshold": 0.25},
]


def test_front_end_refuses_invalid_overrides(input_processors, monkeypatch):
    """Patch 7: the input processor of a selfspec engine refuses bad overrides (key and reason);
    a plain engine's passes them through as before; vLLM's servers answer the error with 400."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    spec, plain = input_processors
    for extra, key, reason in BAD_OVERRIDES:
        with pytest.raises(ValueError) as info:
            _process(spec, extra)
        message = str(info.value)
        assert repr(key) in message and reason in message, (extra, message)
        assert isinstance(info.value, VLLMValidationError) and info.value.parameter == key
        err = create_error_response(info.value).error
        assert (err.code, err.param, err.message) == (400, key, message)
        # other engines are untouched
        assert _process(plain, extra).sampling_params.extra_args == extra
    for extra in GOOD_OVERRIDES:
        assert _process(spec, extra).sampling_params.extra_args == extra
    # negative control: without the wrapper vLLM lets every bad override through to the worker
    monkeypatch.setattr(InputProcessor, "_validate_params",
                        InputProcessor._validate_params.__wrapped__)
    for extra, _, _ in BAD_OVERRIDES:
        assert _process(spec, extra).sampling_params.extra_args == extra


def _params(extra_args):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=4, extra_args=extra_args)


def test_async_generate_refuses_before_streaming(input_processors):
    """AsyncLLM.generate raises when called (before a server sends a streamed 200), and otherwise
    returns vLLM's generator unstarted."""
    import inspect
    from types import SimpleNamespace as NS

    from vllm.v1.engine.async_llm import AsyncLLM

    spec, plain = input_processors
    bad_extra, key, _ = BAD_OVERRIDES[0]
    with pytest.raises(ValueError, match=key):
        AsyncLLM.generate(NS(vllm_config=spec.vllm_config), {}, _params(bad_extra), "r")
    for cfg, extra in ((spec.vllm_config, GOOD_OVERRIDES[2]), (plain.vllm_config, bad_extra)):
        gen = AsyncLLM.generate(NS(vllm_config=cfg), {}, _params(extra), "r")
        assert inspect.isasyncgen(gen) and gen.ag_frame is not None and not gen.ag_running
        del gen


def test_request_validation_patch_is_idempotent(input_processors):
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor

    first = (InputProcessor._validate_params, AsyncLLM.generate)
    front_end.install_request_validation()
    front_end.install_request_validation(only_if_imported=True)
    assert (InputProcessor._validate_params, AsyncLLM.generate) == first
    for fn in first:
        assert getattr(fn, "_vllm_selfspec_patched", False)
        assert not getattr(fn.__wrapped__, "_vllm_selfspec_patched", False)


def test_cpu_top_k_only_with_no_draft_tokens():
    """vLLM (no Triton) crashes on top-k-only sampling when a spec-decode step has no drafts."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("the Triton top-k/top-p kernel is used; patch 6 is not installed")
    import vllm.v1.sample.ops.topk_topp_sampler as tts

    patches.apply_patches()
    empty_logits = torch.empty(0, 16)
    empty_k = torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError):
        tts.apply_top_k_only.__wrapped__(empty_logits, empty_k)  # vLLM's own
    out = tts.apply_top_k_top_p_pytorch(empty_logits, empty_k, None, allow_cpu_sync=True)
    assert out.shape == (0, 16)
    # non-empty batches are delegated unchanged
    logits = torch.tensor([[0.1, 2.0, 0.3, 1.0], [3.0, 0.0, 1.0, 2.0]])
    masked = tts.apply_top_k_only(logits.clone(), torch.tensor([1, 2], dtype=torch.int32))
    assert torch.isfinite(masked).sum(dim=1).tolist() == [1, 2]
