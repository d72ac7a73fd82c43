"""The decisions selfspec takes for CUDA vLLM, checked on CPU (no engine start).

The engine-config tests build a real ``VllmConfig`` under vLLM's own CUDA platform class
(``vllm.platforms.cuda.CudaPlatform``, imported with its compiled-ops module stubbed out; the
hardware queries answer as one H100) installed as vLLM's current platform, with Triton reported
present (as on every CUDA install): the runner choice and the async-scheduling default are vLLM's
real CUDA code paths on a real config. What cannot run here (kernels, graph capture, the worker)
is out of reach; the sampler, model-cache and clock tests check the contracts at those
boundaries. See docs/cuda.md.
"""

from __future__ import annotations

import logging
import sys
import types
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from vllm_selfspec.errors import SelfSpecConfigError
from vllm_selfspec.plugin import patches
from vllm_selfspec.plugin.engine_markers import is_selfspec_engine

NUM_LAYERS = 6


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("errors-llama", arch="llama", num_layers=NUM_LAYERS)


# --- vLLM's CUDA platform class on this CPU machine ---------------------------------------------


@pytest.fixture
def cuda_platform(monkeypatch):
    """vLLM's ``CudaPlatform`` as the current platform (every module that bound
    ``current_platform`` at import sees it), ``HAS_TRITON`` True in ``vllm.config.vllm``; all
    undone afterwards."""
    import vllm.config.vllm as vllm_config_module
    import vllm.platforms as platforms
    from vllm.platforms.interface import DeviceCapability

    cpu_platform = platforms.current_platform
    if cpu_platform.is_cuda():  # CUDA vLLM: the real thing
        yield cpu_platform
        return
    if not cpu_platform.is_cpu():
        pytest.skip(f"stands in for CUDA on the CPU platform only, not {type(cpu_platform)}")
    # vllm/platforms/cuda.py imports the CUDA ops library (absent from the CPU build) for its side
    # effect only, and turns cuDNN SDPA off globally
    monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch",
                        types.ModuleType("vllm._C_stable_libtorch"))
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    had_cuda_module = "vllm.platforms.cuda" in sys.modules
    import vllm.platforms.cuda as cuda_module

    class OneH100(cuda_module.CudaPlatform):
        """vLLM's CUDA platform; only the device queries answer without a device."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def device_count(cls) -> int:
            return 1

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

    platform = OneH100()
    monkeypatch.setattr(platforms, "_current_platform", platform)
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("current_platform") is cpu_platform:
            monkeypatch.setattr(module, "current_platform", platform)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    yield platform
    torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    if not had_cuda_module:
        sys.modules.pop("vllm.platforms.cuda", None)
        vars(platforms).pop("cuda", None)


@contextmanager
def _log_lines(name: str):
    """The formatted records of logger ``name`` (vLLM's loggers do not propagate to caplog)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.logger import configure_logging_if_needed

    # what create_engine_config does first, once per process: its dictConfig clears the handlers
    # of every "vllm.*" logger, ours included
    configure_logging_if_needed(EngineArgs().create_logging_config())
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger(name)
    handler, level = _Keep(level=logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _every_warning(monkeypatch) -> None:
    """``vllm.config.vllm``'s ``warning_once`` logs every time (its cache is per process)."""
    import vllm.config.vllm as vllm_config_module

    log = vllm_config_module.logger
    monkeypatch.setattr(log, "warning_once", lambda msg, *args, **kw: log.warning(msg, *args))


def _set_env(monkeypatch, name: str, value: str) -> None:
    import vllm.envs as envs

    monkeypatch.setenv(name, value)
    if envs._is_envs_cache_enabled():  # an engine started in this process froze vLLM's env
        envs.__getattr__.cache_clear()


def _build(model_dir, speculative_config, **kw):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_patches()
    args = EngineArgs(
        model=str(model_dir),
        speculative_config=speculative_config,
        dtype="float32",
        max_model_len=128,
        **kw,
    )
    return args, args.create_engine_config()


def _plain_draft_model(model_dir) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}


def _selfspec_error(error: BaseException) -> BaseException | None:
    """The SelfSpecConfigError behind ``error``: itself, or the one pydantic wrapped (vLLM's
    ``VllmConfig`` is a pydantic dataclass: a ValueError from its ``__post_init__`` reaches the
    caller as a ``ValidationError``, message kept)."""
    if isinstance(error, SelfSpecConfigError):
        return error
    for detail in getattr(error, "errors", lambda: [])():
        inner = (detail.get("ctx") or {}).get("error")
        if isinstance(inner, SelfSpecConfigError):
            return inner
    return None


# --- 1. which model runner ----------------------------------------------------------------------


def test_selfspec_engine_under_cuda_gets_the_v1_runner(cuda_platform, model_dir, monkeypatch):
    from vllm_selfspec.plugin.patches.speculative_config import V2_UNSUPPORTED_FEATURE

    _every_warning(monkeypatch)
    with _log_lines("vllm.config.vllm") as lines:
        _, config = _build(model_dir, {"method": "selfspec"})
    # the config really is a CUDA one
    assert config.device_config.device.type == "cuda"
    assert config.parallel_config.worker_cls == "vllm.v1.worker.gpu_worker.Worker"
    assert is_selfspec_engine(config) and config.speculative_config.method == "draft_model"
    assert V2_UNSUPPORTED_FEATURE in config._get_v2_model_runner_unsupported_features()
    assert config.use_v2_model_runner is False
    assert any(
        "Model Runner V2 does not yet support" in line and V2_UNSUPPORTED_FEATURE in line
        and "using the V1 model runner instead" in line
        for line in lines
    ), lines


def test_plain_draft_model_under_cuda_keeps_v2_and_async_scheduling(cuda_platform, model_dir):
    """The control: the same model as its own ``draft_model`` without selfspec's settings is what
    vLLM would otherwise run for selfspec's rewrite: V2 runner, async scheduling on."""
    args, config = _build(model_dir, _plain_draft_model(model_dir))
    assert config.device_config.device.type == "cuda"
    assert not is_selfspec_engine(config)
    assert config._get_v2_model_runner_unsupported_features() == []
    assert config.use_v2_model_runner is True
    assert args.async_scheduling is None
    assert config.scheduler_config.async_scheduling is True


def test_selfspec_engine_forced_onto_v2_is_refused(cuda_platform, model_dir, monkeypatch):
    _, built = _build(model_dir, {"method": "selfspec"})
    _set_env(monkeypatch, "VLLM_USE_V2_MODEL_RUNNER", "1")
    # at config build: vLLM reads the property in VllmConfig.__post_init__
    with pytest.raises(ValueError) as refused:
        _build(model_dir, {"method": "selfspec"})
    assert "VLLM_USE_V2_MODEL_RUNNER" in str(refused.value)
    assert isinstance(_selfspec_error(refused.value), SelfSpecConfigError)
    # where the worker and the front end read it, on a config built before the variable was set
    with pytest.raises(SelfSpecConfigError, match="VLLM_USE_V2_MODEL_RUNNER"):
        _ = built.use_v2_model_runner
    # the refusal is selfspec's only: a plain draft-model engine is forced onto V2 as asked
    _, plain = _build(model_dir, _plain_draft_model(model_dir))
    assert plain.use_v2_model_runner is True


# --- 2. async scheduling ------------------------------------------------------------------------


def test_selfspec_turns_async_scheduling_off_under_cuda(cuda_platform, model_dir):
    """Left unset, vLLM turns async scheduling on for ``draft_model`` on CUDA (the control test
    above); selfspec sets it off in the engine arguments, before vLLM reads them, and says why."""
    with _log_lines("vllm.selfspec.engine_config") as lines:
        args, config = _build(model_dir, {"method": "selfspec"})
    assert args.async_scheduling is False
    assert config.scheduler_config.async_scheduling is False
    off = [line for line in lines if "async scheduling off" in line]
    assert len(off) == 1 and "synchronous scheduling" in off[0], lines


def test_explicit_async_scheduling_is_refused(cuda_platform, model_dir):
    with pytest.raises(SelfSpecConfigError, match="async scheduling") as refused:
        _build(model_dir, {"method": "selfspec"}, async_scheduling=True)
    assert "--async-scheduling" in str(refused.value)


def test_choose_async_scheduling_rule():
    from vllm_selfspec.plugin.engine_config import choose_async_scheduling

    for value in (None, False):
        args = SimpleNamespace(async_scheduling=value)
        with _log_lines("vllm.selfspec.engine_config") as lines:
            choose_async_scheduling(args)
        assert args.async_scheduling is False
        assert any("async scheduling off" in line for line in lines)
    with pytest.raises(SelfSpecConfigError, match="async_scheduling=True"):
        choose_async_scheduling(SimpleNamespace(async_scheduling=True))


# --- 3. sampler boundaries ----------------------------------------------------------------------


def test_rejected_from_sampled_stays_on_the_sampled_device():
    """Under CUDA's synchronous scheduling the sampled tokens are a device tensor: the count is
    built there (a host ``drafted`` tensor minus a device tensor fails, as on "meta" here)."""
    from vllm_selfspec.plugin.patches.model_runner import rejected_from_sampled

    # row 0: 2 drafts, only the recovered token sampled (both rejected); row 1: both accepted
    # plus the bonus; row 2: no drafts
    sampled = torch.tensor([[5, -1, -1], [7, 8, 9], [3, -1, -1]])
    drafted = [2, 2, 0]
    on_host = rejected_from_sampled(sampled, drafted)
    assert on_host.device.type == "cpu" and on_host.dtype == torch.int32
    assert on_host.tolist() == [2, 0, 0]
    assert rejected_from_sampled(torch.tensor([[5, 6, -1], [7, 8, 9], [3, -1, -1]]),
                                 drafted).tolist() == [1, 0, 0]
    on_meta = rejected_from_sampled(sampled.to("meta"), drafted)
    assert on_meta.device.type == "meta" and on_meta.shape == (3,)
    # vLLM's per-row lists: host
    assert rejected_from_sampled([[5], [7, 8, 9], [3]], drafted).tolist() == [2, 0, 0]


def _sampling_metadata(temperature, top_k, top_p):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    rows = temperature.shape[0]
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=False,
        all_random=False,
        top_p=top_p,
        top_k=top_k,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def test_draft_truncation_gets_float32_logits(monkeypatch):
    """vLLM's CUDA top-k / top-p is a Triton kernel that asserts float32 logits; a bf16 model's
    draft logits are cast before they reach it."""
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp

    from vllm_selfspec.drafting.device_drafter import SelfSpecDeviceProposer

    real = topk_topp.apply_top_k_top_p
    seen: list[torch.dtype] = []

    def apply_top_k_top_p(logits, k, p):
        seen.append(logits.dtype)
        assert logits.dtype == torch.float32, f"top-k/top-p got {logits.dtype} logits"
        return real(logits, k, p)

    monkeypatch.setattr(topk_topp, "apply_top_k_top_p", apply_top_k_top_p)
    proposer = object.__new__(SelfSpecDeviceProposer)  # what the method reads, nothing more
    proposer._enable_probabilistic_draft_probs = True
    proposer.use_fp64_gumbel = False
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    metadata = _sampling_metadata(
        temperature=torch.tensor([0.7, 0.0, 1.0]),
        top_k=torch.tensor([3, 32, 32], dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 0.5]),
    )
    tokens, probs = SelfSpecDeviceProposer._sample_from_logits(proposer, logits, metadata)
    assert seen == [torch.float32]
    assert probs.dtype == torch.float32 and probs.shape == (3, 32)
    top3 = set(logits[0].float().topk(3).indices.tolist())
    assert set(probs[0].nonzero().flatten().tolist()) <= top3 and int(tokens[0]) in top3
    assert int(tokens[1]) == int(logits[1].float().argmax())  # the greedy row


# --- 4. compiled draft models -------------------------------------------------------------------


def _cache(compile_after_start: bool):
    from vllm_selfspec.drafting.model_cache import DraftModelCache

    built: list[str] = []

    def build(key):
        built.append(key)
        return SimpleNamespace(key=key)

    return DraftModelCache(build, compile_after_start=compile_after_start), built


def test_model_cache_off_cpu_runs_only_start_up_models():
    cache, built = _cache(compile_after_start=False)
    start = cache.start_up_model("start")
    assert cache.start_up_model("start") is start
    cache.end_start_up()
    assert cache.settled_model("start") is start
    assert cache.settled_model("later") is None
    assert cache.cached("later") is None
    assert built == ["start"] and len(cache) == 1
    with pytest.raises(RuntimeError, match="end_start_up"):
        cache.start_up_model("later")


def test_model_cache_on_cpu_compiles_a_set_once():
    cache, built = _cache(compile_after_start=True)
    start = cache.start_up_model("start")
    cache.end_start_up()
    later = cache.settled_model("later")
    assert later is not None and later.key == "later"
    assert cache.settled_model("later") is later and cache.cached("later") is later
    assert cache.settled_model("start") is start
    assert built == ["start", "later"]
    with pytest.raises(RuntimeError):
        cache.start_up_model("start")


def _stand_in_proposer():
    from vllm_selfspec.drafting.device_drafter import SelfSpecDeviceProposer

    proposer = object.__new__(SelfSpecDeviceProposer)
    proposer.settings = SimpleNamespace(skip_attention=[1], skip_mlp=[])
    proposer.online = None
    proposer._build_compiled_draft = lambda key: SimpleNamespace(key=key, _skip=None)
    return proposer


@pytest.mark.parametrize("on_cuda", [False, True], ids=["cpu", "cuda"])
def test_load_model_takes_the_cache_rule_from_the_platform(on_cuda, request, monkeypatch):
    from vllm.platforms import current_platform

    import vllm_selfspec.drafting.device_drafter as device_drafter

    if on_cuda:
        request.getfixturevalue("cuda_platform")
    elif not current_platform.is_cpu():
        pytest.skip("the CPU rule needs vLLM's CPU platform")
    monkeypatch.setattr(device_drafter, "attention_layer_names", lambda skip, skipped: ["attn"])
    proposer = _stand_in_proposer()
    proposer.load_model(target_model=None)
    start = (frozenset({1}), frozenset())
    assert proposer.model.key == start
    assert proposer._models.compile_after_start is (not on_cuda)
    later = proposer._models.settled_model((frozenset({2}), frozenset()))
    assert (later is None) is on_cuda


@pytest.mark.parametrize("compile_after_start", [False, True], ids=["cuda", "cpu"])
def test_online_switch_uses_the_eager_explorer_off_cpu(compile_after_start):
    """A set the search settles on after start-up: compiled on CPU, the eager explorer on CUDA
    (a compiled model first run while serving would capture CUDA graphs then); the start-up set
    always gets its compiled (captured) model."""
    proposer = _stand_in_proposer()
    cache, built = _cache(compile_after_start)
    start_key = (frozenset({1}), frozenset())
    start = cache.start_up_model(start_key)
    cache.end_start_up()
    proposer._models = cache
    proposer.online = SimpleNamespace(searching=False)
    proposer._explorer = SimpleNamespace(skip_attention=None, skip_mlp=None)
    settled = (frozenset({2, 3}), frozenset({4}))
    proposer._use_skip_set(*settled)
    if compile_after_start:
        assert proposer.model.key == settled and built == [start_key, settled]
    else:
        assert proposer.model is proposer._explorer and built == [start_key]
        assert (proposer.model.skip_attention, proposer.model.skip_mlp) == settled
    proposer._use_skip_set(*start_key)
    assert proposer.model is start
    # while the search explores, sets draft on the explorer on every platform
    proposer.online.searching = True
    proposer._use_skip_set(frozenset({5}), frozenset())
    assert proposer.model is proposer._explorer


# --- 5. the step clock --------------------------------------------------------------------------


def test_step_clock_on_cpu_measures_at_once():
    from vllm_selfspec.drafting.step_clock import StepClock

    clock = StepClock("cpu")
    assert not clock.on_device
    got: list[float] = []
    clock.measure(1.0, 3.5, got.append)
    assert got == [2.5]
    first = clock.mark()
    assert isinstance(first, float) and clock.mark() >= first
    clock.collect()
    assert got == [2.5]


class _FakeEvent:
    """``torch.cuda.Event`` on CPU: recorded at a scripted time, done when the test says so."""

    now = 0.0  # ms

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.done = False

    def record(self, stream=None) -> None:
        _FakeEvent.now += 1.5
        self.at = _FakeEvent.now

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("StepClock waited for the device")

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.done and end.done
        return end.at - self.at


def test_step_clock_on_cuda_reads_events_at_a_later_collect(monkeypatch):
    from vllm_selfspec.drafting.step_clock import StepClock

    def no_wait(*args, **kwargs):
        raise AssertionError("StepClock waited for the device")

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", no_wait)
    clock = StepClock(torch.device("cuda", 0))
    assert clock.on_device
    got: list[float] = []
    a0, a1, b0, b1 = clock.mark(), clock.mark(), clock.mark(), clock.mark()
    assert isinstance(a0, _FakeEvent) and a0.at is not None
    clock.measure(a0, a1, got.append)
    clock.measure(b0, b1, got.append)
    assert got == []  # never at measure()
    clock.collect()
    assert got == []  # the device has not reached the ends
    b0.done = b1.done = True
    clock.collect()
    assert got == []  # in order: the first interval is still open
    a0.done = a1.done = True
    clock.collect()
    assert got == [pytest.approx(1.5e-3), pytest.approx(1.5e-3)]
    # a device that never catches up: the oldest intervals are dropped, memory stays bounded
    for _ in range(StepClock.MAX_PENDING + 5):
        clock.measure(clock.mark(), clock.mark(), got.append)
    assert len(clock._pending) == StepClock.MAX_PENDING


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_clock_with_real_cuda_events():
    from vllm_selfspec.drafting.step_clock import StepClock

    clock = StepClock("cuda")
    x = torch.randn(1024, 1024, device="cuda")
    got: list[float] = []
    start = clock.mark()
    for _ in range(8):
        x = x @ x
        x = x / x.norm()
    clock.measure(start, clock.mark(), got.append)
    assert got == []  # not before collect()
    torch.cuda.synchronize()  # the test waits; the clock does not
    clock.collect()
    assert len(got) == 1 and 0 < got[0] < 10
