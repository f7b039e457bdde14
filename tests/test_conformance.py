"""The conformance suite's laws, under pytest: each law on each backend, eager and compiled."""

import pytest

from cacheidx.conformance import LAWS


@pytest.mark.parametrize("law", LAWS, ids=[law.name for law in LAWS])
def test_law(law, case):
    if case.compiled and law.eager_only:
        pytest.skip(f"{law.name} is about eager calls")
    law(case)
