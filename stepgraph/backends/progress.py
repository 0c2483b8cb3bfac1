"""Progress lines of the background Inductor compile: started, ready, switched.

A fused whole step can take a minute to compile, and training meanwhile runs the unfused graph
at its own speed, so the user should see that something is on its way without configuring
logging. Python's logging shows nothing below WARNING when unconfigured, and a warning per
phase would be wrong (nothing is amiss) and deduplicated by the warnings filter. So: where the
application configured logging (a handler on the ``stepgraph`` logger or an ancestor), the line
goes to the ``stepgraph`` logger at INFO and the application's levels decide; otherwise it is
printed to stderr. ``STEPGRAPH_PROGRESS=0`` silences both.
"""
from __future__ import annotations

import logging
import sys

from .. import config

log = logging.getLogger("stepgraph")


def progress(msg: str, *args) -> None:
    if not config.get("progress"):
        return
    if log.hasHandlers():
        log.info(msg, *args)
    else:
        # (the watcher thread prints too: one write per line keeps lines whole)
        sys.stderr.write((msg % args if args else msg) + "\n")
        sys.stderr.flush()
