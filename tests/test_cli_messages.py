"""What the command line says: install hints, option suggestions, positional paths after options."""

from __future__ import annotations

import sys

import pytest
from test_cli import assert_clean_exit, run_main

README_EXTRA = 'pip install -c constraints.txt -e ".[{}]"'  # README's Install section, with an extra


def test_a_missing_extra_names_readmes_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "looplm.hf", None)  # `from looplm.hf import ...` raises ImportError
    rc, _, err = run_main(["export", tmp_path / "run", tmp_path / "hf"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert README_EXTRA.format("hf") in err, err


def test_a_hub_source_without_datasets_names_readmes_install_command(monkeypatch):
    from looplm.data.sources import DataError, _iter_hf

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=README_EXTRA.format("datasets").replace("[", r"\[").replace(".", r"\.")):
        next(_iter_hf("hf:nothing", "text"))
