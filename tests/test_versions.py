"""The tested megatron-core range (megatron_hsap/megatron/versions.py): declared in setup.cfg, checked on import."""

from __future__ import annotations

import configparser
import os
import warnings

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_hsap.megatron import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("release", ["0.15.2", "0.16.0", "0.20.0", "0.20.0rc1", "1.0.0"])
def test_a_release_outside_the_tested_range_warns_naming_it_and_the_range(release):
    with pytest.warns(UserWarning, match=f"megatron-core {release} is outside the range megatron-hsap is tested "
                                         "with \\(0.16.1 to 0.19.2\\)"):
        assert versions.check_megatron_core_version(Version(release)) is False


@pytest.mark.parametrize("release", ["0.16.1", "0.17.0", "0.19.2", "0.19.2+abc123"])
def test_a_release_inside_the_tested_range_is_quiet(release):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert versions.check_megatron_core_version(Version(release)) is True


def test_setup_cfg_declares_the_tested_range_and_the_installed_release_is_in_it():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    (requirement,) = [line for line in cfg["options"]["install_requires"].splitlines()
                      if line.strip().startswith("megatron-core")]
    allowed = SpecifierSet(requirement.strip()[len("megatron-core"):])
    low, high = versions.TESTED_RANGE
    assert low in allowed and high in allowed and Version("0.16.0") not in allowed and Version("0.20.0") not in allowed
    assert versions.MEGATRON_CORE_VERSION in allowed
