"""pytest plugin of omni-accum (entry point ``pytest11``): the ``omni_accum_conformance`` fixture.

Kept apart from :mod:`omni_accum.testing` so that a pytest session in an environment with
omni-accum installed starts without importing hypothesis or torch; they load when a test asks
for the fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def load_check_conformance() -> Callable[..., Any]:
    """:func:`omni_accum.testing.check_conformance`; fails the test, naming the ``testing`` extra, when
    hypothesis is not installed (omni-accum itself does not depend on it)."""
    try:
        from omni_accum.testing import check_conformance
    except ImportError as e:
        if "hypothesis" not in str(e):
            raise
        pytest.fail(
            "omni_accum_conformance needs hypothesis, which is not installed: pip install 'omni-accum[testing]'",
            pytrace=False,
        )
    return check_conformance


@pytest.fixture
def omni_accum_conformance() -> Callable[..., Any]:
    """:func:`omni_accum.testing.check_conformance`: ``omni_accum_conformance("my_strategy", {...})``.

    Needs hypothesis (``pip install 'omni-accum[testing]'``); without it the test fails saying so.
    """
    return load_check_conformance()
