"""Graph passes between capture and backends: cleanup (no-op removal) and analysis (mutations)."""
from .cleanup import cleanup
from .analysis import GraphSummary, summarize

__all__ = ["cleanup", "summarize", "GraphSummary"]
