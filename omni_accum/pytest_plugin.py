"""pytest plugin of omni-accum (entry point ``pytest11``): the ``omni_accum_conformance`` fixture.

Kept apart from :mod:`omni_accum.testing` so that a pytest session in an environment with
omni-accum installed starts without importing hypothesis or torch; they load when a test asks
for the fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def omni_accum_conformance() -> Callable[..., Any]:
    """:func:`omni_accum.testing.check_conformance`: ``omni_accum_conformance("my_strategy", {...})``."""
    from omni_accum.testing import check_conformance

    return check_conformance
