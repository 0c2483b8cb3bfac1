"""The real-client corpus on the CPU (clients/): every public training program either captures
and replays equal to eager, or is refused with a clear error before anything changed —
never WRONG, never an unclear error, never a silent eager fallback."""
from __future__ import annotations

import pytest
import torch

from clients import harness

ACCEPTED = {harness.OK, harness.CLEAR, harness.RECAPTURES, "SKIP"}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", harness.names())
def test_client(name):
    r = harness.run_client(name, steps=6)
    assert r.status in ACCEPTED, r.row()
    if r.status == harness.RECAPTURES:
        # Allowed only for a value that became live at its first change (an lr schedule).
        assert "now read live" in r.detail, r.row()
