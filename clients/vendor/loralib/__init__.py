# Vendored verbatim from https://github.com/microsoft/LoRA/blob/c4593f060e6a368d7bb5af5273b8e42810cdef90/loralib/__init__.py (all lines)
# MIT License, Copyright (c) Microsoft Corporation (see LICENSE.md beside this file).
name = "lora"

from .layers import *
from .utils import *
