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


def test_a_raven_architecture_without_model_type_is_huginn(tmp_path):
    """Guards against: folder_family judging Huginn by model_type alone (a config.json naming only
    architectures=["RavenForCausalLM"] is still Huginn)."""
    import json

    from looplm.convert.common import folder_family

    src = make_huginn(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    del config["model_type"]
    (src / "config.json").write_text(json.dumps(config))
    assert folder_family(src) == "huginn"


def test_a_non_empty_output_folder_is_refused_before_writing(tmp_path):
    """Guards against: check_folders accepting an existing folder that already holds files."""
    from looplm.checkpoint import CheckpointError
    from looplm.convert import convert_huginn

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        convert_huginn(make_huginn(tmp_path / "src"), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_pickle_suffixes_are_matched_case_insensitively(tmp_path):
    """Guards against: refuse_pickles comparing the suffix as written (PYTORCH_MODEL.BIN is a pickle too)."""
    from looplm.checkpoint import CheckpointError
    from looplm.convert.common import refuse_pickles

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "PYTORCH_MODEL.BIN").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match="PYTORCH_MODEL.BIN is a pickle file"):
        refuse_pickles(tmp_path)


def test_an_index_naming_a_non_safetensors_shard_is_refused(tmp_path):
    """Guards against: shard_map accepting an index whose shards are not .safetensors files."""
    import json

    from looplm.checkpoint import CheckpointError
    from looplm.convert.common import INDEX, shard_map

    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"w": "model-00001.npz"}}))
    with pytest.raises(CheckpointError, match=r"shard 'model-00001.npz' is not a .safetensors file"):
        shard_map(tmp_path)


def test_a_shard_holding_more_tensors_than_the_index_assigns_is_refused(tmp_path):
    """Guards against: load_tensors checking only that a shard holds the tensors the index assigns it,
    silently reading tensors the index does not name."""
    import torch
    from safetensors.torch import save_file

    from looplm.checkpoint import CheckpointError
    from looplm.convert.common import load_tensors

    save_file({"w": torch.ones(2), "stray": torch.ones(3)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(CheckpointError, match=r"does not hold the tensors .* unexpected \['stray'\]"):
        load_tensors(tmp_path, {"w": "a.safetensors"})


def test_special_ids_refuse_booleans_and_ids_outside_the_vocabulary(tmp_path):
    """Guards against: eos_token_id = true read as id 1 (bool is an int subclass), and an id the tokenizer
    does not have accepted (or reported as a missing eos instead of a wrong id)."""
    from looplm.checkpoint import CheckpointError
    from looplm.convert.common import hf_tokenizer

    hf = _tokenizer_folder(tmp_path / "rel")
    with pytest.raises(CheckpointError, match="no eos_token"):
        hf_tokenizer(tmp_path / "rel", {"eos_token_id": True})
    with pytest.raises(CheckpointError, match=f"eos_token_id {hf.get_vocab_size() + 7} is not a token"):
        hf_tokenizer(tmp_path / "rel", {"eos_token_id": hf.get_vocab_size() + 7})


def test_config_json_ids_win_over_generation_config(tmp_path):
    """Guards against: generation_config.json read before config.json (or the last source read winning)."""
    from looplm.convert.common import hf_tokenizer

    hf = _tokenizer_folder(tmp_path / "rel")
    a, b, c = (hf.token_to_id(t) for t in ("<a>", "<b>", "<c>"))
    (tmp_path / "rel" / "generation_config.json").write_text(f'{{"eos_token_id": {c}, "pad_token_id": {c}}}')
    tok, _ = hf_tokenizer(tmp_path / "rel", {"eos_token_id": a, "pad_token_id": b})
    assert (tok.eos_id, tok.pad_id) == (a, b)
    tok, _ = hf_tokenizer(tmp_path / "rel", {"eos_token_id": a})
    assert (tok.eos_id, tok.pad_id) == (a, c)  # generation_config fills only what config.json lacks


def test_a_converted_job_trains_no_longer_than_the_models_context(tiny_model_config):
    """Guards against: the job's data.seq_len kept at the S preset's value for a model whose context is shorter."""
    from looplm.convert.common import job_dict

    assert job_dict(tiny_model_config(max_seq_len=48), "/tok", 4)["data"]["seq_len"] == 48


@pytest.mark.parametrize("dtype, name", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_conversion_records_the_written_dtype_by_name(tmp_path, dtype, name):
    """Guards against: conversion.json recording 'torch.float32' instead of the plain dtype name."""
    import json

    from looplm.convert import convert_huginn

    out = convert_huginn(make_huginn(tmp_path / "src"), tmp_path / "out", dtype=dtype)
    assert json.loads((out / "conversion.json").read_text())["dtype"] == name


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    """Guards against: check_vocab dropped (token ids past the embedding rows would index out of range); the refusal
    names the tokenizer, not a tensor shape."""
    from test_convert_huginn import hf_tokenizer as raven_tokenizer

    from looplm.checkpoint import CheckpointError
    from looplm.convert import convert_huginn

    vocab = raven_tokenizer().get_vocab_size()
    src = make_huginn(tmp_path / "src", padded_vocab_size=vocab - 1, vocab_size=vocab - 1)
    with pytest.raises(CheckpointError, match=f"the tokenizer has {vocab} tokens, more than the model's {vocab - 1}"):
        convert_huginn(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
