"""The reference device's options."""

from __future__ import annotations

import pytest

from inferhal.backends.reference.device import check_options
from inferhal.core.errors import UserError


def test_an_unknown_backend_option_is_named_with_the_known_ones():
    check_options({"torch_device": "cpu"})
    with pytest.raises(UserError, match=r"unknown option\(s\) \['torch_devcie'\].*torch_device"):
        check_options({"torch_devcie": "cpu"})
