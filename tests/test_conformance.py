"""The conformance suite's laws, under pytest: each law on each backend and mode
(``cacheidx_case`` comes from cacheidx's pytest plugin)."""

import pytest

from cacheidx.conformance import LAWS


@pytest.mark.parametrize("law", LAWS, ids=[law.name for law in LAWS])
def test_law(law, cacheidx_case):
    if not law.runs(cacheidx_case.mode):
        pytest.skip(f"{law.name} checks {law.checks}")
    law(cacheidx_case)
