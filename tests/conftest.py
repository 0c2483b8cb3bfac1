import os
import sys

# Tests import the checkout's stepgraph (installed or not) and the shared harness beside them.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

