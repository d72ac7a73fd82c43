"""Tiny random-weight decoder models for tests, with a locally trained tokenizer.

Nothing here touches a model hub: the tokenizer is a byte-level BPE trained in-process on a small
built-in corpus (English sentences, a bit of Python, the Zen of Python), and the model is a
randomly initialised ``transformers`` model saved as safetensors. The folder loads in both
``transformers`` and vLLM (CPU and GPU).

* :func:`build_tiny_model` writes a model folder (config, safetensors, tokenizer, chat template).
* :func:`tiny_model_dir` builds once into a cache folder keyed by its arguments and reuses it.

Defaults: hidden 128, 4 heads -> head_dim 32 (vLLM's CPU attention supports head sizes
32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512), 2 KV heads, 4 layers, vocab 576.
``initializer_range`` defaults to 0.2 (transformers' default 0.02 gives an almost flat next-token
distribution, so greedy outputs would be near-ties); with 0.2 the greedy top-1 probability is
typically far above uniform.

Biases (qwen2's q/k/v) are random N(0, initializer_range) and RMSNorm weights N(1, 0.1) rather
than transformers' 0 / 1, so that weight-loading bugs for them are visible.

``zero_output_layers`` zeroes ``self_attn.o_proj`` and ``mlp.down_proj`` of those layers, so the
layers add nothing to the residual stream: skipping them is exact.

``sliding_window`` (mistral, qwen2, qwen3) makes every layer attend to the last ``sliding_window``
positions only: mistral's ``sliding_window``; for qwen2/qwen3 ``use_sliding_window=True`` with
``max_window_layers=0`` (vLLM refuses a mix of windowed and full layers for them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# vLLM CPU attention (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes)
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# bump when the output of build_tiny_model changes for the same arguments (invalidates caches)
BUILDER_VERSION = 2

TOKENIZER_VOCAB_SIZE = 512
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, IM_START, IM_END]

# ChatML, like SmolLM2/Qwen. The assistant turn ends with <|im_end|>, then EOS is not needed.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS_SENTENCES = """\
The quick brown fox jumps over the lazy dog.
A journey of a thousand miles begins with a single step.
Hello world! This is a small test of the tokenizer.
Speculative decoding drafts several tokens with a cheap model and verifies them with the full one.
When the draft agrees with the target model, the output is exactly the same, only faster.
Skipping some layers of a transformer gives a cheaper draft model for free.
The cat sat on the mat and looked out of the window at the rain.
It was a bright cold day in April, and the clocks were striking thirteen.
Once upon a time there was a little girl who lived in a village near the forest.
The weather today is sunny with a light breeze from the west.
Please write a short story about a robot who learns to paint.
Can you explain how a hash table works in simple terms?
What is the capital of France? The capital of France is Paris.
What is the capital of Japan? The capital of Japan is Tokyo.
Water boils at one hundred degrees Celsius at sea level.
The sun rises in the east and sets in the west.
There are seven days in a week and twelve months in a year.
One, two, three, four, five, six, seven, eight, nine, ten.
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 2024 3.14159
The model reads the prompt, computes attention over all previous tokens, and predicts the next one.
A large language model is trained on a lot of text to predict the next word.
Machine learning is the study of algorithms that improve through experience.
The server answered the request in less than a second.
I would like a cup of tea with milk and no sugar, please.
She opened the book and began to read the first chapter aloud.
They walked along the river until the sun went down behind the hills.
The train to London leaves from platform nine at half past three.
Good morning! How are you today? I am fine, thank you.
Summarize the following paragraph in one sentence.
Translate this sentence into French: the house is red.
Write a function that returns the sum of two numbers.
Write a Python function to check whether a string is a palindrome.
Return the list of prime numbers smaller than n.
Given a list of integers, return the largest element.
The answer is 42. The question is harder to find.
Users: Tell me a joke. Assistant: Why did the chicken cross the road?
Science, history, music, art, sports, travel, food, health and technology.
Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.
The mountain was covered in snow, and the valley below was green.
In the middle of difficulty lies opportunity.
Knowledge is power, and practice makes perfect.
The meeting has been moved to Thursday afternoon at two o'clock.
Remember to save your work before you close the program.
The engine starts, loads the weights, allocates the cache and begins to serve requests.
"""

_CORPUS_CODE = '''\
def add(a, b):
    """Return the sum of a and b."""
    return a + b


def is_palindrome(s: str) -> bool:
    s = s.lower()
    return s == s[::-1]


def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()


import os
import sys
from typing import List, Dict

for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

result = {"name": "test", "values": [1, 2, 3], "ok": True, "none": None}
'''


def _zen_of_python() -> str:
    import codecs

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import)
    return codecs.decode(this.s, "rot13")


def tokenizer_corpus() -> list[str]:
    """The built-in training corpus (deterministic)."""
    lines = [ln for ln in _CORPUS_SENTENCES.splitlines() if ln.strip()]
    lines += [ln for ln in _zen_of_python().splitlines() if ln.strip()]
    lines.append(_CORPUS_CODE)
    # a chat-formatted sample so that the ChatML markers' neighbourhood is seen in training
    lines.append("user\nHello, who are you?\nassistant\nI am a tiny test model.\n")
    return lines


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> str:
    """Train the byte-level BPE once per process; returns the ``tokenizers`` JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # prepend BOS like Llama tokenizers do; byte-level offsets untouched
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok.to_str()


def build_tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """A fresh ``PreTrainedTokenizerFast`` (trained once per process, cached)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _make_config(
    arch: str,
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    max_position_embeddings: int,
    initializer_range: float,
    tie_word_embeddings: bool,
    dtype: str,
    token_ids: dict[str, int],
    sliding_window: int | None = None,
):
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
        dtype=dtype,
    )
    # qwen2/qwen3: every layer windowed (max_window_layers=0) or none
    qwen_window: dict[str, Any] = dict(use_sliding_window=False, sliding_window=None)
    if sliding_window is not None:
        qwen_window = dict(use_sliding_window=True, sliding_window=sliding_window,
                           max_window_layers=0)
    if arch == "llama":
        if sliding_window is not None:
            raise ValueError("llama has no sliding window; use arch='mistral'")
        return transformers.LlamaConfig(head_dim=head_dim, **common)
    if arch == "mistral":
        return transformers.MistralConfig(
            head_dim=head_dim, sliding_window=sliding_window, **common
        )
    if arch == "qwen2":
        if head_dim != hidden_size // num_heads:
            raise ValueError("qwen2 has no head_dim setting: head_dim must be hidden/heads")
        return transformers.Qwen2Config(**qwen_window, **common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, **qwen_window, **common)
    raise ValueError(f"unknown arch {arch!r}; expected one of {TINY_ARCHS}")


def build_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int | None = None,
    seed: int = 0,
    max_position_embeddings: int = 1024,
    zero_output_layers: Iterable[int] = (),
    dtype: str = "float32",
    head_dim: int | None = None,
    initializer_range: float = 0.2,
    tie_word_embeddings: bool = False,
    sliding_window: int | None = None,
) -> Path:
    """Write a random-initialised causal LM + tokenizer into ``out_dir`` and return its path.

    ``vocab_size`` defaults to the tokenizer size rounded up to a multiple of 64 (576); a larger
    value just adds never-produced-by-the-tokenizer rows. ``zero_output_layers``: layer indices
    whose ``self_attn.o_proj`` and ``mlp.down_proj`` weights (and biases, if any) are zero, so that
    skipping those layers is exact. ``sliding_window``: every layer attends to that many most
    recent positions (not for llama); the weights are the same as without it. Deterministic for
    fixed arguments.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    arch = arch.lower()
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {TINY_ARCHS}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError("hidden_size must be divisible by num_heads (or pass head_dim)")
        head_dim = hidden_size // num_heads
    if head_dim not in CPU_ATTN_HEAD_SIZES:
        raise ValueError(
            f"head_dim {head_dim} is not supported by vLLM's CPU attention {CPU_ATTN_HEAD_SIZES}"
        )
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    zero_output_layers = sorted({int(i) for i in zero_output_layers})
    for i in zero_output_layers:
        if not 0 <= i < num_layers:
            raise ValueError(f"zero_output_layers index {i} out of range [0, {num_layers})")

    tokenizer = build_tiny_tokenizer()
    n_tok = len(tokenizer)
    if vocab_size is None:
        vocab_size = _round_up(n_tok, 64)
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {n_tok}")

    config = _make_config(
        arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        sliding_window=sliding_window,
        token_ids={
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "pad": tokenizer.pad_token_id,
        },
    )

    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    # initialise in float32 (deterministic), then cast
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        # transformers initialises biases to 0 and norm weights to 1: randomise them too, so that
        # loading bugs for those tensors (qwen2 qkv biases, qwen3 q/k norms, final norm) show up
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            elif pname.endswith(".bias"):
                param.normal_(0.0, initializer_range)
        layers = model.model.layers
        for i in zero_output_layers:
            for proj in (layers[i].self_attn.o_proj, layers[i].mlp.down_proj):
                proj.weight.zero_()
                if getattr(proj, "bias", None) is not None:
                    proj.bias.zero_()
    model = model.to(torch_dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    meta: dict[str, Any] = {"sliding_window": sliding_window} if sliding_window else {}
    (out / "tiny_model.json").write_text(
        json.dumps(
            {
                "builder_version": BUILDER_VERSION,
                "arch": arch,
                "num_layers": num_layers,
                "hidden_size": hidden_size,
                "intermediate_size": intermediate_size,
                "num_heads": num_heads,
                "num_kv_heads": num_kv_heads,
                "head_dim": head_dim,
                "vocab_size": vocab_size,
                "seed": seed,
                "zero_output_layers": zero_output_layers,
                "dtype": dtype,
                "initializer_range": initializer_range,
                **meta,
            },
            indent=1,
        )
    )
    return out


def tiny_cache_root() -> Path:
    """``$VLLM_SELFSPEC_CACHE`` or ``~/.cache/vllm-selfspec``."""
    root = os.environ.get("VLLM_SELFSPEC_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-selfspec"
    )
    return Path(root)


def tiny_model_dir(name: str = "tiny", **kw: Any) -> Path:
    """Build a tiny model once into the cache folder (keyed by ``name`` and the args) and reuse it.

    ``kw`` are :func:`build_tiny_model` arguments (except ``out_dir``). Building is atomic (a
    temporary sibling folder renamed into place), so concurrent processes are safe.
    """
    if "out_dir" in kw:
        raise TypeError("tiny_model_dir chooses out_dir itself")
    key_args = dict(kw)
    if "zero_output_layers" in key_args:
        key_args["zero_output_layers"] = sorted({int(i) for i in key_args["zero_output_layers"]})
    key = json.dumps({"v": BUILDER_VERSION, "args": key_args}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    root = tiny_cache_root() / "tiny-models"
    final = root / f"{safe_name}-{digest}"
    if (final / "tiny_model.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{safe_name}-", dir=root))
    try:
        build_tiny_model(tmp, **kw)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "tiny_model.json").is_file():
                # a stale, incomplete folder: replace it
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model %s", final)
    return final
