"""A GGUF chat model's tokenizer, built once through transformers and kept in the user's cache.

Building the tokenizer from a GGUF file through transformers takes seconds (it reads every
metadata array into Python objects, then converts them); loading the result with the
``tokenizers`` library takes a fraction of one. So the first use builds it and keeps, in
``$XDG_CACHE_HOME/cacheidx/tokenizers`` (``~/.cache/cacheidx/tokenizers`` without it), the
tokenizer's JSON, its chat template and its special tokens, under a key of the file's size and
a SHA-256 of its metadata (everything a tokenizer is built from): a changed file gets a key of
its own and is built again. An entry is written to a temporary folder and renamed into place,
so a half-written entry is never read; one that cannot be read is built again.

Chat ids are those of ``apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)``: the template rendered as transformers renders it (a sandboxed Jinja
environment, ``trim_blocks`` and ``lstrip_blocks``), then encoded without special tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ChatTokenizer", "cache_root", "file_key", "load"]

VERSION = 1  # of the entry's layout: a new one never reads an old one


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/cacheidx`` (``~/.cache/cacheidx`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cacheidx"


def file_key(path: str) -> str:
    """The file's size and a SHA-256 of its metadata (the bytes before its tensors' data)."""
    from .gguf_file import open_gguf

    size = os.path.getsize(path)
    head = open_gguf(path).data_offset
    h = hashlib.sha256(f"v{VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(head))
    return h.hexdigest()[:32]


class ChatTokenizer:
    """Token ids of chat messages, and text of ids, as the model's transformers tokenizer
    gives them."""

    def __init__(self, tokenizer: Any, template: str, special: dict[str, str],
                 clean_up_spaces: bool):
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.tokenizer = tokenizer
        self.special = dict(special)
        self.clean_up_spaces = clean_up_spaces
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
            x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.special)

    def chat_ids(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Any) -> str:
        text = self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
        return _clean_up(text) if self.clean_up_spaces else text


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                 (" 're", "'re")):
        text = text.replace(a, b)
    return text


def build_with_transformers(path: str) -> tuple[str, str, dict[str, str], bool]:
    """(tokenizer JSON, chat template, special tokens, clean-up flag) of the GGUF file at
    ``path``, from transformers' ``AutoTokenizer`` (the slow way, done once)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                        gguf_file=os.path.basename(path))
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    return (tok.backend_tokenizer.to_str(), tok.chat_template, special,
            bool(getattr(tok, "clean_up_tokenization_spaces", False)))


def load(path: str, *, build: Callable[[str], tuple] = build_with_transformers,
         root: Path | None = None, progress: Callable[[str], None] | None = None
         ) -> ChatTokenizer:
    """The chat tokenizer of the GGUF file at ``path``: from the cache where an entry for the
    file's key is there and readable, otherwise built with ``build`` and kept."""
    from tokenizers import Tokenizer

    root = (cache_root() if root is None else root) / "tokenizers"
    stem = Path(path).name
    entry = root / f"{stem}-{file_key(path)}"
    if entry.is_dir():
        try:
            return _read(entry, Tokenizer)
        except Exception:  # unreadable: built again below
            shutil.rmtree(entry, ignore_errors=True)
    if progress:
        progress(f"building the tokenizer of {stem} (once; kept in {root})")
    text, template, special, clean = build(path)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=root))
    try:
        (tmp / "tokenizer.json").write_text(text, encoding="utf-8")
        (tmp / "chat.json").write_text(json.dumps(
            {"version": VERSION, "chat_template": template, "special": special,
             "clean_up_tokenization_spaces": clean}), encoding="utf-8")
        for old in root.glob(f"{stem}-*"):  # the entries of an earlier version of the file
            shutil.rmtree(old, ignore_errors=True)
        for left in root.glob(f".{stem}-*"):  # what a process that died while writing left
            if left != tmp and time.time() - left.stat().st_mtime > 3600:
                shutil.rmtree(left, ignore_errors=True)
        os.rename(tmp, entry)
    except OSError:  # another process put it there first, or the cache is read-only
        shutil.rmtree(tmp, ignore_errors=True)
    if entry.is_dir():
        try:
            return _read(entry, Tokenizer)
        except Exception:
            pass
    return ChatTokenizer(Tokenizer.from_str(text), template, special, clean)


def _read(entry: Path, tokenizer_cls: Any) -> ChatTokenizer:
    meta = json.loads((entry / "chat.json").read_text(encoding="utf-8"))
    if meta.get("version") != VERSION:
        raise ValueError(f"an entry of version {meta.get('version')}")
    tok = tokenizer_cls.from_file(str(entry / "tokenizer.json"))
    return ChatTokenizer(tok, meta["chat_template"], meta["special"],
                         meta["clean_up_tokenization_spaces"])
