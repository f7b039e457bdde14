"""Quick model loads: the GGUF file read without the ``gguf`` package's reader, dequantised bit
for bit as that package does, and the chat tokenizer kept in the user's cache."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the reference reader and dequantisation are gguf's")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from cacheidx.models import chat_tokenizer as ct  # noqa: E402
from cacheidx.models import gguf_file  # noqa: E402

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0]


def write_gguf(path, *, vocab=("a", "b", "c"), tensors=None, name="tiny"):
    """A small Llama-like GGUF file, written by the gguf package."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_token_list(list(vocab))
    w.add_token_scores([0.5] * len(vocab))
    for tname, (array, qtype) in (tensors or {}).items():
        w.add_tensor(tname, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def quantised(shape, qtype, seed=0):
    x = (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)
    x[0, :3] = [0.0, -0.0, 1e-8]
    return quants.quantize(x, qtype) if qtype != Q.F32 else x


def test_the_reader_agrees_with_gguf_on_fields_and_tensors(tmp_path):
    tensors = {f"t.{t.name}": (quantised((6, 64), t, i), t) for i, t in enumerate(TYPES)}
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    mine, ref = gguf_file.open_gguf(path), gguf.GGUFReader(path)
    assert mine.fields["llama.block_count"] == 1
    assert mine.fields["general.architecture"] == "llama"
    assert mine.fields["#tokenizer.ggml.tokens"] == 3
    assert mine.fields["#tokenizer.ggml.scores"] == 3
    for t in ref.tensors:
        m = mine.tensors[t.name]
        assert (m.type, m.shape) == (int(t.tensor_type), tuple(int(d) for d in t.shape[::-1]))
        assert np.array_equal(m.data, np.asarray(t.data).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantisation_is_gguf_s_bit_for_bit(qtype, tmp_path):
    shape = (70, 96)  # more rows than one transposed chunk of 96 columns holds
    path = write_gguf(tmp_path / "m.gguf", tensors={"w": (quantised(shape, qtype), qtype)})
    t = gguf_file.open_gguf(path).tensors["w"]
    want = quants.dequantize(t.data, qtype).reshape(shape).astype(np.float32)
    got = gguf_file.dequantize(t)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    order = np.random.default_rng(1).permutation(shape[0])
    t_got = gguf_file.dequantize_transposed(t, order)
    assert t_got.flags.c_contiguous
    np.testing.assert_array_equal(t_got.view(np.uint32), want[order].T.view(np.uint32))


def test_the_smollm2_file_dequantises_as_gguf_does_for_each_of_its_types():
    from cacheidx.models import gguf as model_gguf

    try:
        path = model_gguf.smollm2_path()
    except model_gguf.ModelMissing as e:
        pytest.skip(str(e))
    f = gguf_file.open_gguf(path)
    seen = set()
    for t in f.tensors.values():  # one of each type, and the largest of the Q4_1 ones
        if t.type in seen and t.name != "blk.0.ffn_down.weight":
            continue
        seen.add(t.type)
        want = quants.dequantize(t.data, Q(t.type)).reshape(t.shape).astype(np.float32)
        np.testing.assert_array_equal(gguf_file.dequantize(t).view(np.uint32),
                                      want.view(np.uint32))
    assert seen >= {Q.Q4_1, Q.F32}


# -- the tokenizer cache -----------------------------------------------------------------------
class Builds:
    """A builder standing in for transformers: a word-level tokenizer, counted."""

    def __init__(self):
        self.count = 0

    def __call__(self, path):
        from tokenizers import Tokenizer, models, pre_tokenizers

        self.count += 1
        tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1, "there": 2, "<s>": 3},
                                         unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        template = "{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
        return tok.to_str(), template, {"bos_token": "<s>"}, False


@pytest.fixture
def cache(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers", reason="the chat tokenizer is the tokenizers library's")
    pytest.importorskip("jinja2", reason="chat templates are rendered with jinja2")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "cacheidx" / "tokenizers"


def test_the_tokenizer_is_built_once_then_read_from_the_cache(cache, tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    build = Builds()
    tok = ct.load(path, build=build)
    assert tok.chat_ids([{"role": "user", "content": "hi there"}]) == [3, 1, 2]
    assert build.count == 1
    (entry,) = cache.iterdir()
    assert entry.name.startswith("m.gguf-")
    again = ct.load(path, build=build)
    assert build.count == 1 and again.decode([1, 2]) == "hi there"


def test_a_changed_file_is_built_again_and_its_old_entry_dropped(cache, tmp_path):
    build = Builds()
    path = write_gguf(tmp_path / "m.gguf", vocab=("a", "b"))
    ct.load(path, build=build)
    (old,) = cache.iterdir()
    write_gguf(tmp_path / "m.gguf", vocab=("a", "c"))  # same size, other metadata
    ct.load(path, build=build)
    (new,) = cache.iterdir()
    assert build.count == 2 and new != old


def test_a_half_written_or_broken_entry_is_never_read(cache, tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    build = Builds()
    ct.load(path, build=build)
    (entry,) = cache.iterdir()
    # a process that died while writing leaves only a hidden temporary folder: ignored
    (cache / ".m.gguf-dead").mkdir()
    (cache / ".m.gguf-dead" / "tokenizer.json").write_text("{")
    ct.load(path, build=build)
    assert build.count == 1
    (entry / "tokenizer.json").write_text('{"truncat')  # broken: built again, and kept
    tok = ct.load(path, build=build)
    assert build.count == 2 and tok.chat_ids([{"role": "user", "content": "hi"}]) == [3, 1]
    ct.load(path, build=build)
    assert build.count == 2
    meta = json.loads((entry / "chat.json").read_text())
    (entry / "chat.json").write_text(json.dumps({**meta, "version": -1}))  # another layout
    ct.load(path, build=build)
    assert build.count == 3


def test_the_cache_lives_under_xdg_cache_home_or_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ct.cache_root() == tmp_path / "cacheidx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ct.cache_root() == tmp_path / "home" / ".cache" / "cacheidx"


def test_smollm2_chat_ids_equal_transformers_apply_chat_template(cache):
    """Built through transformers into an empty cache, then read back: the same ids as
    transformers' own ``apply_chat_template`` and the same text from ``decode``."""
    pytest.importorskip("transformers", reason="the reference tokenizer is transformers'")
    from cacheidx.models import gguf as model_gguf

    try:
        path = model_gguf.smollm2_path()
    except model_gguf.ModelMissing as e:
        pytest.skip(str(e))
    ref = model_gguf.tokenizer()
    ct.load(path)
    mine = ct.load(path, build=lambda _: pytest.fail("the cache was not read"))
    for prompt in ["What is the capital of France?", "Write a haiku about the sea.", "x"]:
        msgs = [{"role": "user", "content": prompt}]
        want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert mine.chat_ids(msgs) == want
        assert mine.decode(want) == ref.decode(want)
    assert os.listdir(cache)


def test_loading_shows_progress_on_a_terminal_only(monkeypatch):
    import io
    import sys

    from cacheidx.models import gguf as model_gguf

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert model_gguf._progress_line("m.gguf") is None  # a log keeps no progress lines
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    show = model_gguf._progress_line("m.gguf")
    show(1, 2)
    show(2, 2)
    text = term.getvalue()
    assert "\rdequantising m.gguf: 1/2 tensors" in text and text.endswith("\n")
