"""A moved module's old name: its names are the new module's, with a warning that says where they went."""

from __future__ import annotations

import json

import pytest

from miles.compat import moved_module


def test_a_name_of_the_old_module_is_the_new_modules_with_a_warning() -> None:
    getattr_ = moved_module("miles.old_json", "json", distribution="miles-json")
    with pytest.warns(DeprecationWarning, match=r"miles.old_json moved to json \(in miles-json\)"):
        assert getattr_("dumps") is json.dumps
    with pytest.raises(AttributeError):
        getattr_("__path__")  # the import machinery's probes are not forwarded


def test_a_new_module_that_is_not_installed_names_its_distribution() -> None:
    getattr_ = moved_module("miles.training.gone", "no_such_package_xyz.gone", distribution="miles-xyz")
    with pytest.raises(
        ImportError, match=r"^miles.training.gone moved to no_such_package_xyz.gone: pip install miles-xyz$"
    ):
        getattr_("anything")
