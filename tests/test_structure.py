"""The package's structure (issue 16): where shared exceptions live, the Runner contract every
backend returns, and the keyword-built stage objects. Behaviour is covered by the parity suites."""
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_exceptions_every_backend_may_raise_live_in_errors():
    """``NeedsReplay`` lived in backends/cudagraph.py although every backend may raise it."""
    from stepgraph import errors
    from stepgraph.backends import cudagraph, segments
    from stepgraph.capture import hostreads
    assert errors.NeedsReplay.__module__ == "stepgraph.errors"
    assert issubclass(errors.NeedsHostScalars, errors.NeedsReplay)
    assert issubclass(errors.NeedsReplay, errors.CaptureError)
    assert errors.GuardMiss.__module__ == "stepgraph.errors"
    # the backends and the graph's host guard raise these very classes (imported, not redefined)
    assert cudagraph.NeedsReplay is errors.NeedsReplay and segments.NeedsReplay is errors.NeedsReplay
    assert cudagraph.NeedsHostScalars is errors.NeedsHostScalars
    assert hostreads.GuardMiss is errors.GuardMiss
