"""`looplm convert` reads config.json's model type before converting: a looplm checkpoint or export needs
no conversion, and another family's folder is named with the --from that reads it (not a converter's
field error or a Python internal such as "int() argument ... 'NoneType'")."""

from __future__ import annotations

import pytest
from test_convert_huginn import make_huginn
from test_convert_ouro import make_ouro
from test_convert_parcae import make_parcae
from test_convert_xllm_loop import make_release

from looplm.cli import main

FAMILIES = ["xllm-loop", "huginn", "ouro", "parcae"]
MAKERS = {"xllm-loop": make_release, "huginn": make_huginn, "ouro": make_ouro, "parcae": make_parcae}


def convert(capsys, src, out, family):
    rc = main(["convert", str(src), str(out), "--from", family])
    _, err = capsys.readouterr()
    return rc, err.strip()


@pytest.mark.parametrize("source", FAMILIES)
def test_another_familys_folder_names_its_from(tmp_path, capsys, source):
    src = MAKERS[source](tmp_path / "src")
    for family in FAMILIES:
        if family == source:
            continue
        rc, err = convert(capsys, src, tmp_path / f"out-{family}", family)
        assert rc == 2 and err.count("\n") == 0, err
        assert f"looks like {source}" in err and f"--from {source}" in err, err
        assert "NoneType" not in err and not (tmp_path / f"out-{family}").exists()


def test_a_looplm_checkpoint_or_export_needs_no_conversion(tmp_path, capsys):
    pytest.importorskip("transformers")
    ckpt = tmp_path / "converted"
    assert main(["convert", str(make_ouro(tmp_path / "src")), str(ckpt), "--from", "ouro"]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    for src, what in ((ckpt, "a looplm checkpoint"), (tmp_path / "hf", "a looplm export")):
        for family in FAMILIES:
            rc, err = convert(capsys, src, tmp_path / f"out-{family}", family)
            assert rc == 2 and err.count("\n") == 0, err
            assert f"is {what}" in err and "no conversion needed" in err, err


# -- shared reading and writing helpers (looplm.convert.common) --------------------------------------
def test_an_index_naming_a_shard_outside_the_folder_is_refused(tmp_path):
    """'../x.safetensors' in the index
    would read a file beside the release folder."""
    import json

    from looplm.checkpoint import CheckpointError
    from looplm.convert.common import INDEX, shard_map

    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / INDEX).write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="points outside the folder"):
        shard_map(tmp_path / "rel")


def test_an_integer_tensor_of_the_right_shape_is_refused(tmp_path):
    """Int weights would be cast to float32 silently."""
    import torch
    from safetensors.torch import save_file

    from looplm.checkpoint import CheckpointError
    from looplm.convert.common import read_checked

    save_file({"w": torch.ones(2, 3), "ids": torch.arange(4, dtype=torch.int32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="ids is torch.int32, expected a floating-point tensor"):
        read_checked(tmp_path, {"w": (2, 3), "ids": (4,)}, family="test")
    got = read_checked(tmp_path, {"w": (2, 3)}, {"ids": (4,)}, family="test", ignore=("ids",))
    assert list(got) == ["w"] and got["w"].dtype == torch.float32


def _tokenizer_folder(root, specials=("<a>", "<b>", "<c>"), **files):
    import json

    from test_convert_huginn import hf_tokenizer

    root.mkdir()
    tok = hf_tokenizer(specials)
    tok.save(str(root / "tokenizer.json"))
    for name, data in files.items():
        (root / f"{name}.json").write_text(json.dumps(data))
    return tok


def test_special_tokens_map_names_win_over_tokenizer_config(tmp_path):
    """The
    special-tokens map is read first and a name it gives is kept."""
    from looplm.convert.common import hf_tokenizer

    hf = _tokenizer_folder(
        tmp_path / "rel",
        special_tokens_map={"eos_token": {"content": "<a>"}},
        tokenizer_config={"eos_token": "<b>", "pad_token": "<c>"},
    )
    tok, note = hf_tokenizer(tmp_path / "rel", {})
    assert (tok.eos_id, tok.pad_id, note) == (hf.token_to_id("<a>"), hf.token_to_id("<c>"), None)


def test_an_eos_id_list_names_its_first_token(tmp_path):
    """Config.json's eos_token_id may be a list (Llama-3 style); its first id is
    the eos token, and padding falls back to it with a note."""
    from looplm.convert.common import hf_tokenizer

    hf = _tokenizer_folder(tmp_path / "rel")
    first, second = hf.token_to_id("<b>"), hf.token_to_id("<c>")
    tok, note = hf_tokenizer(tmp_path / "rel", {"eos_token_id": [first, second]})
    assert tok.eos_id == tok.pad_id == first and "padding uses eos" in note


def test_a_converted_job_records_its_depth_cap_and_held_out_data(tiny_model_config):
    """Guards against the fixed-depth recipe's cap set to max_depth even below 64, and against a given --data
    replaced by the built-in text."""
    from looplm.convert.common import job_dict
    from looplm.data.record import BUILTIN_TEXT

    small = job_dict(tiny_model_config(max_depth=16), "/tok", 4, data="/corpora/held.txt")
    assert small["depth"]["sampler"] == "fixed" and small["depth"]["depth"] == 4.0
    assert small["depth"]["cap"] == 64 and small["data"]["source"] == "/corpora/held.txt"
    large = job_dict(tiny_model_config(max_depth=128), "/tok", 4)
    assert large["depth"]["cap"] == 128 and large["data"]["source"] == BUILTIN_TEXT
