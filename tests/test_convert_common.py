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
