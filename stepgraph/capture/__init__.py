"""Capture: find the step's state, trace it at the aten level, build its guards."""
