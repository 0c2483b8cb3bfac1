"""The real-client corpus on the CPU (clients/): every public training program either captures
and replays equal to eager, or is refused with a clear error before anything changed —
never WRONG, never an unclear error, never a silent eager fallback, never a guard that misses
again and again (RECAPTURES; a variant the loop takes once more, e.g. an epoch's first call, is
captured once: clients/harness.py)."""
from __future__ import annotations

import pytest

from clients import harness

ACCEPTED = {harness.OK, harness.CLEAR, "SKIP"}


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


@pytest.mark.parametrize("name", harness.names())
def test_client(name):
    r = harness.run_client(name, steps=6)
    assert r.status in ACCEPTED, r.row()
