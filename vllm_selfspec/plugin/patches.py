"""Every place where vllm-selfspec touches vLLM internals.

Each patch wraps and delegates to the vLLM original, says why it exists, is idempotent, and is
installed only when the installed vLLM lies in :data:`SUPPORTED_VLLM`. None of them changes the
behaviour of an engine that did not ask for ``"method": "selfspec"``.

1. ``EngineArgs.create_speculative_config``: the user contract is
   ``{"method": "selfspec", ...selfspec keys...}``. vLLM's ``SpeculativeConfig`` knows no such
   method and forbids unknown keys, so the wrapper validates the selfspec keys against the served
   model (clear errors at engine start), rewrites the method into vLLM's ``custom_class`` proposer
   hook pointing at :class:`vllm_selfspec.drafting.host_drafter.SelfSpecProposer`, and ships the
   resolved
   settings inside ``VllmConfig.additional_config["selfspec"]``: that object travels with the
   config to every worker (multiprocessing and Ray), and two engines in one process each carry
   their own.
2. ``VllmConfig.num_lookahead_tokens``: vLLM reserves lookahead KV slots only for EAGLE-style
   drafters. Our draft steps write K/V up to ``k`` positions past the verified tokens, so the
   scheduler must reserve ``k`` lookahead slots for us too.
3. ``rejection_sampler.expand_batch_to_tokens`` (vLLM CPU build without Triton only): the C++
   ``expand_kernel_impl`` fills an int64 *copy* of a float32/int32 output and the function returns
   uninitialised memory, so rejection sampling at temperature > 0 uses garbage temperatures /
   top-k / top-p for every speculative method. The wrapper computes the expansion with PyTorch for
   those dtypes and delegates otherwise.
4. ``GPUModelRunner._input_fits_in_drafter`` (per runner instance, selfspec runners only): vLLM
   switches drafting off for the *whole batch* as soon as one request is within ``k`` tokens of
   ``max_model_len``. Our proposer clips each request's draft length itself, so it keeps drafting
   for the others. ``GPUModelRunner._bookkeeping_sync`` (same instance patch, CPU only): see
   :func:`patch_runner_cpu_discarded_generators` (a seeded request with a chunked prefill
   killed the engine core).
5. ``StatLoggerManager.__init__`` (front-end process only; installed by
   :func:`vllm_selfspec.plugin.metrics.install` when a selfspec config is built, or at plugin load
   when
   vLLM's metrics loggers are already imported): appends the plugin's own Prometheus logger
   (``vllm:selfspec_*`` metrics) to the stat loggers of selfspec engines only.
6. ``topk_topp_sampler.apply_top_k_only`` (vLLM without Triton only, i.e. the CPU build): with any
   speculative method vLLM runs every step through the rejection sampler, also steps in which no
   request has drafts; the target logits are then ``[0, vocab]`` and, for a batch with a top-k-only
   request (``top_k`` set, ``top_p`` not), ``k.max()`` of the empty ``k`` raises and kills the
   engine core (one ``"top_k": 1`` request takes the whole server down). The wrapper returns the
   empty logits unchanged and delegates otherwise.
7. ``InputProcessor._validate_params`` and ``AsyncLLM.generate`` (front-end process only;
   installed when a selfspec config is built, or at plugin load for the modules already
   imported): per-request overrides (``SamplingParams.extra_args["selfspec"]``, or flat
   ``selfspec_<key>`` entries, which the OpenAI server fills from ``vllm_xargs``) reach vLLM as
   opaque ``extra_args``, so an invalid one used to be ignored by the worker with a log line. The
   input processor is where vLLM validates every other sampling parameter of a request before it
   becomes an ``EngineCoreRequest``; the wrapper delegates, then checks the overrides against the
   engine's ``k_max`` and raises :func:`request_error_type` (a ``ValueError`` for ``LLM.generate``
   callers and a ``VLLMValidationError``, which vLLM's servers answer with 400), naming the key and
   the reason. ``AsyncLLM.generate`` is an async generator: it reaches the input processor only when
   first iterated, and a streamed response has sent its 200 by then. Its wrapper runs the same check
   when it is called (the servers call it before they start the response), then returns vLLM's
   generator. Engines without the selfspec method are not touched.
8. ``GPUModelRunner.__init__`` (worker processes; installed lazily by an import hook when
   ``vllm.v1.worker.gpu_model_runner`` is first imported): a selfspec engine with
   ``"drafter": "device"`` runs as vLLM's ``draft_model`` method with the target as the draft
   model, and vLLM's runner would build a ``DraftModelProposer`` that loads a second copy of the
   weights and KV cache. On those engines only, the wrapper delegates with the runner module's
   ``DraftModelProposer`` name pointing to
   :class:`vllm_selfspec.drafting.device_drafter.SelfSpecDeviceProposer` (a subclass, so every
   runner
   gate for ``draft_model`` passes), so that vLLM builds ours in its place; a runner that built
   something else is refused at start. With it, the drafter wraps its runner's
   ``take_draft_token_ids`` (:func:`patch_runner_take_draft_token_ids`): per-request draft
   lengths and the confidence exit cut drafts where vLLM moves them to the host, and its
   ``propose_draft_token_ids`` (:func:`patch_runner_propose_without_drafts`): a step whose
   plan runs no draft pass skips vLLM's draft-input preparation.
9. ``GPUModelRunner._sample`` (per runner instance, selfspec runners only, both drafters): a step
   in which no request has drafts is sampled by vLLM's plain sampler, as a plain engine samples
   it, instead of going through the rejection sampler (see
   :func:`patch_runner_sample_without_drafts`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllm_selfspec.plugin.engine_markers import (
    ADDITIONAL_CONFIG_KEY,
    METHOD_NAME,
    is_selfspec_config,
    wants_device_drafter,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vllm.selfspec.patches")

SUPPORTED_VLLM = (">=0.32", "<0.34")

_SENTINEL = "_vllm_selfspec_patched"
_applied = False


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "0")


def check_vllm_version(version: str | None = None) -> str | None:
    """Return None when ``version`` is supported, else a message saying what is supported."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = version or vllm_version()
    spec = SpecifierSet(",".join(SUPPORTED_VLLM))
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"vllm-selfspec cannot parse the installed vLLM version {version!r}"
    # Treat dev/rc builds of a supported release as that release.
    if Version(parsed.base_version) in spec:
        return None
    return (
        f"vllm-selfspec supports vLLM {','.join(SUPPORTED_VLLM)}, but vLLM {version} is installed; "
        "install a supported vLLM (CPU: pip install 'vllm-selfspec[cpu]', "
        "GPU: pip install 'vllm-selfspec[cuda]')"
    )


def apply_patches() -> None:
    """Install every global patch once per process (called from the plugin entry point)."""
    global _applied
    if _applied:
        return
    _applied = True
    problem = check_vllm_version()
    if problem is not None:
        # Engines that do not ask for selfspec must keep working: only the alias patch is installed,
        # and it refuses "selfspec" with this message.
        logger.warning("%s; the selfspec method is disabled.", problem)
        _patch_create_speculative_config(unsupported=problem)
        return
    _patch_create_speculative_config()
    _patch_num_lookahead_tokens()
    _patch_cpu_expand_batch_to_tokens()
    _patch_cpu_empty_top_k_only()
    _install_metrics(only_if_imported=True)
    install_request_validation(only_if_imported=True)
    install_device_drafter()


# --- 1. the "selfspec" method alias -------------------------------------------------------------


def _patch_create_speculative_config(unsupported: str | None = None) -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, _SENTINEL, False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") == METHOD_NAME:
            if unsupported is not None:
                from vllm_selfspec.errors import SelfSpecConfigError

                raise SelfSpecConfigError(unsupported)
            from vllm_selfspec.plugin.engine_config import rewrite_selfspec_request

            self.speculative_config, settings = rewrite_selfspec_request(
                spec, self, target_model_config, target_parallel_config
            )
            additional = dict(self.additional_config or {})
            additional[ADDITIONAL_CONFIG_KEY] = settings
            self.additional_config = additional
            _install_metrics()
            install_request_validation()
        return original(self, target_model_config, target_parallel_config)

    setattr(create_speculative_config, _SENTINEL, True)
    create_speculative_config.__wrapped__ = original  # type: ignore[attr-defined]
    EngineArgs.create_speculative_config = create_speculative_config


# --- 2. lookahead KV slots --------------------------------------------------------------------


def _patch_num_lookahead_tokens() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig.num_lookahead_tokens
    if getattr(original.fget, _SENTINEL, False):
        return

    def num_lookahead_tokens(self) -> int:
        if is_selfspec_config(self.speculative_config):
            return self.speculative_config.num_speculative_tokens
        return original.fget(self)

    setattr(num_lookahead_tokens, _SENTINEL, True)
    num_lookahead_tokens.__wrapped__ = original  # type: ignore[attr-defined]  (vLLM's property)
    VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens, doc=original.__doc__)


# --- 3. CPU rejection-sampler bug -------------------------------------------------------------


def cpu_expand_bug_present() -> bool:
    """True where vLLM expands sampling parameters with the broken C++ op (CPU, no Triton)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def _patch_cpu_expand_batch_to_tokens() -> None:
    if not cpu_expand_bug_present():
        return
    import torch
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    original = rejection_sampler.expand_batch_to_tokens
    if getattr(original, _SENTINEL, False):
        return

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.dtype == torch.int64:  # the C++ op fills int64 outputs in place: correct as it is
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        out = torch.repeat_interleave(x, counts, output_size=num_tokens)
        if replace_from != replace_to:
            out = out.masked_fill(out == replace_from, replace_to)
        return out

    setattr(expand_batch_to_tokens, _SENTINEL, True)
    expand_batch_to_tokens.__wrapped__ = original  # type: ignore[attr-defined]
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


# --- 4. per-runner: do not switch drafting off for the whole batch ----------------------------


def patch_runner_input_fits_in_drafter(runner: Any) -> None:
    """Instance patch on one selfspec model runner (never on the class)."""
    original = runner._input_fits_in_drafter
    if getattr(original, _SENTINEL, False):
        return

    def _input_fits_in_drafter(common_attn_metadata):
        # The proposer clips every request to max_model_len itself; only "no metadata" means
        # there is nothing to draft for.
        return common_attn_metadata is not None

    setattr(_input_fits_in_drafter, _SENTINEL, True)
    _input_fits_in_drafter.__wrapped__ = original  # type: ignore[attr-defined]
    runner._input_fits_in_drafter = _input_fits_in_drafter


def patch_runner_cpu_discarded_generators(runner: Any) -> None:
    """Instance patch on one selfspec model runner on CPU (never on the class).

    ``GPUModelRunner._bookkeeping_sync`` rewinds the generator of a seeded request whose sampled
    token is discarded (a partial prefill) with ``gen.set_offset(gen.get_offset() - 4)``, a
    CUDA Philox offset; a CPU ``torch.Generator`` raises ``CPU Generator does not use offset``
    and the engine core dies (one request with a ``seed`` chunked in a busy selfspec step took a
    whole OpenAI server down: the verification tokens fill the batch budget, so prefills are
    chunked far more often than in plain decoding). The wrapper hides the discarded rows'
    generators from that loop (their draws are not rewound: the sampled distribution is
    unchanged, a seeded output may depend on how its prefill was chunked) and delegates.
    """
    from vllm.platforms import current_platform

    original = getattr(runner, "_bookkeeping_sync", None)
    if original is None or getattr(original, _SENTINEL, False) or not current_platform.is_cpu():
        return

    def _bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        generators = runner.input_batch.generators
        num_reqs = runner.input_batch.num_reqs
        hidden = {}
        if generators:
            for i in runner.discard_request_mask.np[:num_reqs].nonzero()[0]:
                if int(i) in generators:
                    hidden[int(i)] = generators.pop(int(i))
        try:
            return original(*args, **kwargs)
        finally:
            generators.update(hidden)

    setattr(_bookkeeping_sync, _SENTINEL, True)
    _bookkeeping_sync.__wrapped__ = original  # type: ignore[attr-defined]
    runner._bookkeeping_sync = _bookkeeping_sync


# --- 5. the plugin's own metrics (front end) --------------------------------------------------


def _install_metrics(only_if_imported: bool = False) -> None:
    """Lazy on purpose: importing vLLM's metrics loggers costs about a second, and only front ends
    that build a selfspec engine (or imported them already) need the wrapper."""
    import sys

    if only_if_imported and "vllm.v1.metrics.loggers" not in sys.modules:
        return
    try:
        from vllm_selfspec.plugin.metrics import install
    except ImportError as exc:  # pragma: no cover - a vLLM without that module
        logger.warning("selfspec metrics unavailable: %s", exc)
        return
    install()


# --- 6. CPU top-k-only on an empty batch of draft tokens ----------------------------------------


def _patch_cpu_empty_top_k_only() -> None:
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # the Triton top-k/top-p kernel is used instead
        return
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp_sampler

    original = topk_topp_sampler.apply_top_k_only
    if getattr(original, _SENTINEL, False):
        return

    def apply_top_k_only(logits, k):
        if k.numel() == 0:  # no rows (a step without draft tokens): nothing to mask
            return logits
        return original(logits, k)

    setattr(apply_top_k_only, _SENTINEL, True)
    apply_top_k_only.__wrapped__ = original  # type: ignore[attr-defined]
    topk_topp_sampler.apply_top_k_only = apply_top_k_only


# --- 7. per-request overrides refused when the request arrives (front end) ----------------------



@functools.cache
def request_error_type() -> type[ValueError]:
    """The error of a refused per-request override: a ``ValueError`` (what ``LLM.generate``
    callers catch) and vLLM's ``VLLMValidationError`` (its servers answer 400 and name the
    ``parameter``). Built on first use: this module imports nothing from vLLM when it loads."""
    from vllm.exceptions import VLLMValidationError

    class SelfSpecRequestError(VLLMValidationError, ValueError):
        """A per-request selfspec override is invalid for this engine."""

        def __str__(self) -> str:  # the message names the key already: no "(parameter=...)"
            return Exception.__str__(self)

    SelfSpecRequestError.__module__ = __name__
    SelfSpecRequestError.__qualname__ = SelfSpecRequestError.__name__
    return SelfSpecRequestError


def selfspec_k_max(vllm_config: Any) -> int | None:
    """The engine's maximum draft length (what the drafter uses), None for other engines."""
    spec = getattr(vllm_config, "speculative_config", None)
    if not (is_selfspec_config(spec) or wants_device_drafter(vllm_config)):
        return None
    return int(spec.num_speculative_tokens)


def check_request_overrides(extra_args: Mapping[str, Any] | None, k_max: int) -> None:
    """Raise :func:`request_error_type` for the first invalid selfspec override in
    ``extra_args`` (a ``SamplingParams.extra_args``), with the key as the client wrote it and the
    reason. Reads the overrides as the drafter does (nested dict first, else flat entries)."""
    if not extra_args:
        return
    from vllm_selfspec.control.controller import (
        FLAT_PREFIX,
        OVERRIDES_KEY,
        flat_overrides,
        validate_request_overrides,
    )

    error = request_error_type()
    nested = extra_args.get(OVERRIDES_KEY)
    flat_keys = sorted(k for k in extra_args if isinstance(k, str) and k.startswith(FLAT_PREFIX))
    if nested is not None and flat_keys:
        raise error(
            f"per-request selfspec overrides: give either {OVERRIDES_KEY!r} (a dict) or flat "
            f"{FLAT_PREFIX}<key> entries, not both (got {OVERRIDES_KEY!r} and {flat_keys[0]!r})",
            parameter=OVERRIDES_KEY,
        )
    if nested is not None:
        if not isinstance(nested, Mapping):
            raise error(
                f"per-request selfspec override {OVERRIDES_KEY!r} must be a dict of overrides, "
                f"got {type(nested).__name__}",
                parameter=OVERRIDES_KEY,
            )
        items = [(f"{OVERRIDES_KEY}.{key}", key, value) for key, value in nested.items()]
    else:
        flat = flat_overrides(dict(extra_args)) or {}
        items = [(FLAT_PREFIX + key, key, value) for key, value in flat.items()]
    for name, key, value in items:
        try:
            validate_request_overrides({key: value}, k_max=k_max)
        except ValueError as exc:
            raise error(f"per-request selfspec override {name!r} refused: {exc}",
                        parameter=name) from None


def check_sampling_params(vllm_config: Any, params: Any) -> None:
    """:func:`check_request_overrides` for a request's params on a selfspec engine; nothing for
    other engines or for pooling params."""
    k_max = selfspec_k_max(vllm_config)
    if k_max is None:
        return
    check_request_overrides(getattr(params, "extra_args", None), k_max)


def install_request_validation(only_if_imported: bool = False) -> None:
    """Lazy like :func:`_install_metrics`: the two vLLM modules cost seconds to import, and only
    front ends that build an engine (which imports them) need the wrappers."""
    if not only_if_imported or "vllm.v1.engine.input_processor" in sys.modules:
        _patch_input_processor_validation()
    if not only_if_imported or "vllm.v1.engine.async_llm" in sys.modules:
        _patch_async_generate_validation()


def _patch_input_processor_validation() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    original = getattr(InputProcessor, "_validate_params", None)
    if original is None:  # pragma: no cover - a vLLM that renamed the hook
        logger.warning("vLLM's InputProcessor has no _validate_params: per-request selfspec "
                       "overrides are checked by the drafter only (invalid ones are ignored)")
        return
    if getattr(original, _SENTINEL, False):
        return

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        check_sampling_params(self.vllm_config, params)
        return result

    setattr(_validate_params, _SENTINEL, True)
    InputProcessor._validate_params = _validate_params


def _patch_async_generate_validation() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.generate
    if getattr(original, _SENTINEL, False):
        return

    @functools.wraps(original)
    def generate(self, prompt, sampling_params, *args, **kwargs):
        # Eager on purpose (a plain function returning vLLM's async generator): the error is
        # raised by the call, before a server has started a streamed 200 response.
        check_sampling_params(self.vllm_config, sampling_params)
        return original(self, prompt, sampling_params, *args, **kwargs)

    setattr(generate, _SENTINEL, True)
    AsyncLLM.generate = generate


# --- 8. the device drafter on the model runner --------------------------------------------------

_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def install_device_drafter() -> None:
    """Patch the runner now if its module is imported, else right after its first import (the
    plugin entry point stays cheap: nothing of vLLM's worker is imported for it)."""
    module = sys.modules.get(_RUNNER_MODULE)
    if module is not None:
        _patch_runner_init(module)
    elif not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport(_RUNNER_MODULE, _patch_runner_init))


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after module ``name`` is executed (one shot)."""

    def __init__(self, name: str, patch: Any) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch_runner_init(module: Any) -> None:
    """Device-drafter engines get
    :class:`~vllm_selfspec.drafting.device_drafter.SelfSpecDeviceProposer`
    where vLLM builds its ``DraftModelProposer``: the runner module's name for that class points
    to ours while the runner's own constructor runs (one proposer built, not vLLM's and then
    ours). Other engines are untouched."""
    cls = module.GPUModelRunner
    original = cls.__init__
    if getattr(original, _SENTINEL, False):
        return

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        if not wants_device_drafter(vllm_config):
            return original(self, vllm_config, *args, **kwargs)
        from vllm_selfspec.drafting.device_drafter import SelfSpecDeviceProposer

        vllm_class = module.DraftModelProposer
        module.DraftModelProposer = SelfSpecDeviceProposer
        try:
            original(self, vllm_config, *args, **kwargs)
        finally:
            module.DraftModelProposer = vllm_class
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, SelfSpecDeviceProposer):
            raise RuntimeError(
                "selfspec: vLLM's model runner did not build the device drafter (this vLLM "
                "version builds its draft-model proposer elsewhere); use drafter 'host'"
            )
        _patch_device_drafter_runner(self, drafter)

    setattr(__init__, _SENTINEL, True)
    cls.__init__ = __init__


def _patch_device_drafter_runner(runner: Any, drafter: Any) -> None:
    """The instance patches of a runner that built the device drafter (each below says why)."""
    patch_runner_input_fits_in_drafter(runner)
    patch_runner_cpu_discarded_generators(runner)
    patch_runner_take_draft_token_ids(runner, drafter.trim)
    patch_runner_propose_without_drafts(
        runner, drafter.plan_before_preparation, drafter.sampled_token_observer()
    )
    patch_runner_sample_without_drafts(runner, drafter.count_plain_sampled)


def patch_runner_take_draft_token_ids(runner: Any, trim: Any) -> None:
    """Instance wrap of ``runner.take_draft_token_ids`` (device drafter): each request's drafts
    go through ``trim(req_ids, drafts)`` when the engine core takes them. The padded draft pass
    drafts the same length for every row; this is where per-request budgets and the confidence
    exit cut them, at the point vLLM moves drafts to the host anyway."""
    original = runner.take_draft_token_ids
    if getattr(original, _SENTINEL, False):
        return

    def take_draft_token_ids() -> Any:
        result = original()
        if result is None:
            return None
        return dataclasses.replace(
            result, draft_token_ids=trim(result.req_ids, result.draft_token_ids)
        )

    setattr(take_draft_token_ids, _SENTINEL, True)
    take_draft_token_ids.__wrapped__ = original  # type: ignore[attr-defined]
    runner.take_draft_token_ids = take_draft_token_ids


def rejected_from_sampled(sampled_token_ids: Any, num_draft_tokens: Any) -> torch.Tensor:
    """Per row, the drafts rejected this step, as vLLM's ``prepare_inputs_padded`` counts them:
    ``drafted + 1 - valid`` where a row had drafts (valid: sampled tokens that are not the
    ``-1`` padding of rejected positions), else 0. ``sampled_token_ids``: the padded tensor (a
    host tensor on CPU) or vLLM's per-row lists."""
    import torch

    drafted = torch.as_tensor(list(num_draft_tokens), dtype=torch.int32)
    rows = drafted.shape[0]
    if isinstance(sampled_token_ids, torch.Tensor):
        valid = (sampled_token_ids[:rows] >= 0).sum(dim=1, dtype=torch.int32)
    else:
        valid = torch.tensor([len(r) for r in sampled_token_ids[:rows]], dtype=torch.int32)
    return torch.where(drafted > 0, drafted + 1 - valid, torch.zeros_like(drafted))


def patch_runner_propose_without_drafts(
    runner: Any, plan_step: Any, see_sampled: Callable[[Any], None] | None = None
) -> None:
    """Instance wrap of ``runner.propose_draft_token_ids`` (device drafter, CPU).

    Before it calls the drafter, vLLM's runner prepares the draft pass's inputs on every step:
    the next tokens and rejected counts (``prepare_next_token_ids_padded``,
    ``prepare_inputs_padded``) and the target slices. When the drafter then plans no pass
    (every request capped at 0 or switched off, or, with prompt lookup, every drafting request
    drafting by lookup) they are thrown away: that preparation was a third of the measured cost
    of a selfspec engine whose every request has drafting switched off (the overhead floor).
    The wrapper asks ``plan_step(num_spec_tokens_to_schedule, batch_size, num_rejected)``
    first; it returns the (empty) drafts when no pass runs, else ``None`` and the wrapper
    delegates. ``num_rejected``, the drafts each request had rejected this step (``None`` on a
    step that verified none), is counted here from the sampled tokens as vLLM's preparation
    counts it (``drafted + 1 - valid sampled`` for a row with drafts, else 0): on the CPU
    platform they are host memory. Runners that copy sampled-token counts to the host for the
    next step (``valid_sampled_token_count_event``, CUDA) always delegate: there the count would
    be a device sync. ``see_sampled`` gets every step's sampled tokens first (vLLM hands them
    to the runner's method, not to the drafter's ``propose``): the prompt-lookup source matches
    n-grams that end in them.
    """
    original = runner.propose_draft_token_ids
    if getattr(original, _SENTINEL, False):
        return

    def propose_draft_token_ids(
        scheduler_output: Any,
        sampled_token_ids: Any,
        sampling_metadata: Any,
        hidden_states: Any,
        sample_hidden_states: Any,
        aux_hidden_states: Any,
        spec_decode_metadata: Any,
        common_attn_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if see_sampled is not None:
            see_sampled(sampled_token_ids)
        if getattr(runner, "valid_sampled_token_count_event", None) is None:
            num_draft = getattr(spec_decode_metadata, "num_draft_tokens", ())
            drafts = plan_step(
                scheduler_output.num_spec_tokens_to_schedule,
                common_attn_metadata.batch_size(),
                rejected_from_sampled(sampled_token_ids, num_draft) if any(num_draft) else None,
            )
            if drafts is not None:
                # what vLLM's method resets before proposing: no draft probabilities this step
                runner._draft_probs = None
                runner._draft_prob_req_ids = None
                return drafts
        return original(
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            hidden_states,
            sample_hidden_states,
            aux_hidden_states,
            spec_decode_metadata,
            common_attn_metadata,
            *args,
            **kwargs,
        )

    setattr(propose_draft_token_ids, _SENTINEL, True)
    propose_draft_token_ids.__wrapped__ = original  # type: ignore[attr-defined]
    runner.propose_draft_token_ids = propose_draft_token_ids


def patch_runner_sample_without_drafts(
    runner: Any, on_plain_step: Callable[[], None] | None = None
) -> None:
    """Instance wrap of ``runner._sample`` (selfspec runners only).

    vLLM 0.32 keys its runner's speculative path on the config, not on the step: every step of a
    speculative engine builds spec-decode metadata and samples through the rejection sampler,
    also a step in which no request has drafts (a prefill, requests capped at 0, drafting
    switched off by the controller). There the rejection sampler's output is the bonus token,
    drawn by the same plain sampler, plus indexing, casts and a rejection pass over an empty
    draft set: ~0.4 ms a step on CPU, the largest part of the overhead floor. On such a step the
    wrapper calls vLLM's ``_sample`` without the metadata, which samples with the plain sampler
    exactly as a plain engine does (same logits rows: one per request; same generator draws).
    Steps with drafts delegate unchanged. ``on_plain_step`` is called on each step sampled so.
    Can go once vLLM keys the speculative path on the scheduled drafts.
    """
    original = runner._sample
    if getattr(original, _SENTINEL, False):
        return

    def _sample(logits: Any, spec_decode_metadata: Any) -> Any:
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
            if on_plain_step is not None:
                on_plain_step()
        return original(logits, spec_decode_metadata)

    setattr(_sample, _SENTINEL, True)
    _sample.__wrapped__ = original  # type: ignore[attr-defined]
    runner._sample = _sample
