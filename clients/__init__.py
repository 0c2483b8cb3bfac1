"""The real-client corpus: public training programs run eager vs stepgraph (see harness.py)."""
