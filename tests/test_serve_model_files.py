"""What ``python -m cacheidx.serve --model PATH`` and ``cit.load`` say of the files at a path
(issue 26, items 8 and 14): a model that cannot be read is bad usage, exit 2, on one line
naming the path and what is wrong, never a traceback; a missing path is said to be missing, a
path that is no string refused naming the function; a model without a tokenizer answers with
its token ids. The tiny Llama of ``hf_models``, saved offline into a temporary folder.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

for _module in ("torch", "transformers"):
    pytest.importorskip(_module, reason=f"the transformers integration needs `{_module}`")

from hf_models import greedy, tiny  # noqa: E402

from cacheidx.integrations import transformers as cit  # noqa: E402
from cacheidx.serve.__main__ import main  # noqa: E402

PROMPT = [5, 9, 2, 7]
LOAD = "cacheidx.integrations.transformers.load"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(folder, model)``: the tiny Llama as save_pretrained writes it, no tokenizer."""
    folder = tmp_path_factory.mktemp("models") / "llama"
    model = tiny("llama")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture
def requests(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"id": "r", "prompt_ids": PROMPT}) + "\n")
    return str(path)


def refusal(requests, folder, capsys) -> str:
    """The command's status 2 and its last line on stderr (transformers logs its own first)."""
    assert main([requests, "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_a_truncated_weights_file_exits_2_naming_the_path(saved, requests, tmp_path, capsys):
    folder = shutil.copytree(saved[0], tmp_path / "truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    # (the reader's own words after its error's name are safetensors', which vary)
    assert refusal(requests, folder, capsys).startswith(
        f"cacheidx.serve: cannot serve {folder}: {LOAD}: cannot read the model at "
        f"'{folder}': SafetensorError: Error while deserializing header")


def test_weights_of_other_sizes_than_the_config_exit_2_naming_a_tensor(saved, requests,
                                                                       tmp_path, capsys):
    folder = shutil.copytree(saved[0], tmp_path / "resized")
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128)
    (folder / "config.json").write_text(json.dumps(config))
    assert refusal(requests, folder, capsys) == (
        f"cacheidx.serve: cannot serve {folder}: {LOAD}: the weights at '{folder}' do not "
        "match its config: lm_head.weight is [128, 32] in the weights, [128, 64] by the "
        "config (21 tensors differ)")


def test_without_a_tokenizer_an_answer_is_its_token_ids(saved, requests, capsys):
    folder, model = saved
    want = greedy(model, PROMPT, 5)
    assert main([requests, "--model", str(folder), "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == f"[r] {' '.join(map(str, want))}\n"
    assert main([requests, "--model", str(folder), "--max-new-tokens", "5", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)["requests"]
    assert got["tokens"] == want and got["text"] is None


def test_load_says_a_missing_path_does_not_exist(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match=f"^{LOAD}: '{missing}' does not exist"):
        cit.load(missing)


@pytest.mark.parametrize("path", [None, 3, b"model"])
def test_load_refuses_a_path_that_is_no_string_naming_the_function(path):
    with pytest.raises(TypeError, match=f"^{LOAD}: path must be a string or a path, got "
                                        f"{path!r}$"):
        cit.load(path)


def test_load_takes_a_pathlib_path(saved):
    folder, model = saved
    loaded = cit.load(pathlib.Path(folder))
    assert loaded.path == str(folder) and loaded.tokenizer is None
