"""A transformers model from a local path: a folder ``save_pretrained`` wrote, or a GGUF file
(transformers dequantises it), with its tokenizer where the path holds one. Nothing is
downloaded: the path is read as it is."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["Loaded", "load"]

_WHERE = "cacheidx.integrations.transformers.load"
#: the files of a folder's tokenizer, any of which save_pretrained writes
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model read from ``path``, in eval mode, and its tokenizer (``None``: the path has
    none that loads, ``missing`` says why, so requests give token ids)."""

    path: str
    model: Any
    tokenizer: Any = None
    missing: str = ""

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))

    def template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation under the tokenizer's chat template, with the generation
        prompt added. Raises ``ValueError`` where the path has no tokenizer or no template."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name} has no tokenizer ({self.missing}): give "
                             "\"prompt_ids\"")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"{self.name}'s tokenizer has no chat template: give "
                             "\"prompt_ids\"")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                 tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (empty without a tokenizer: the ids are the answer)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids))


def load(path: str | os.PathLike, *, dtype: Any = None) -> Loaded:
    """The model at ``path`` (a ``save_pretrained`` folder or a ``.gguf`` file), on the CPU in
    ``dtype`` (float32 by default) and eval mode, and its tokenizer where it has one.

    Raises ``TypeError`` for a ``path`` that is no string or path, and ``ValueError`` naming
    the path where nothing is there, where it is neither, and where its model cannot be read
    (a truncated weights file, weights of other sizes than its config says: the first such
    tensor named)."""
    if not isinstance(path, str | os.PathLike) or not isinstance(os.fspath(path), str):
        raise TypeError(f"{_WHERE}: path must be a string or a path, got {path!r:.60}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{_WHERE}: {path!r} does not exist (so it is neither a folder "
                         "save_pretrained wrote nor a .gguf file)")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    if os.path.isfile(path) and path.endswith(".gguf"):
        where, extra = os.path.dirname(os.path.abspath(path)), {"gguf_file":
                                                                 os.path.basename(path)}
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        where, extra = path, {}
    else:
        raise ValueError(f"{_WHERE}: {path!r} is neither a folder save_pretrained wrote (with "
                         "a config.json) nor a .gguf file")
    try:  # the sizes checked here, not by transformers' error that points to its log
        model, info = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype, local_files_only=True, ignore_mismatched_sizes=True,
            output_loading_info=True, **extra)
    except ImportError:  # a package the format needs: said as it is
        raise
    except Exception as e:  # whatever the format's reader raises for a file it cannot read
        raise ValueError(f"{_WHERE}: cannot read the model at {path!r}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}") from e
    if info["mismatched_keys"]:
        key, stored, wanted = sorted(info["mismatched_keys"])[0]
        raise ValueError(f"{_WHERE}: the weights at {path!r} do not match its config: {key} is "
                         f"{list(stored)} in the weights, {list(wanted)} by the config "
                         f"({len(info['mismatched_keys'])} tensors differ)")
    model.eval()
    if not extra and not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        # (transformers would make an empty tokenizer of the model's class)
        return Loaded(path, model, None, "the folder holds no tokenizer files")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **extra)
    except Exception as e:  # weights alone, or a tokenizer transformers cannot build: the
        # requests give ids, and one with messages says why it cannot be tokenised
        return Loaded(path, model, None, f"{type(e).__name__}: {str(e)[:200]}")
    return Loaded(path, model, tokenizer)
