"""Stands in for ``gymnasium.spaces`` (not installed): the two space classes CleanRL's SAC,
TD3 and DQN use (``Box``, ``Discrete``), with the attributes their scripts and the replay
buffer (buffers.py beside this file) read (``shape``, ``dtype``, ``low``, ``high``, ``n``) and a
seeded ``sample()``. Written for the corpus, not vendored code."""
import numpy as np


class Space:
    def __init__(self, shape, dtype, seed=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.np_random = np.random.default_rng(seed)

    def seed(self, seed):
        self.np_random = np.random.default_rng(seed)


class Box(Space):
    def __init__(self, low, high, shape, dtype=np.float32, seed=None):
        super().__init__(shape, dtype, seed)
        self.low = np.full(shape, low, dtype=dtype)
        self.high = np.full(shape, high, dtype=dtype)

    def sample(self):
        return self.np_random.uniform(self.low, self.high, size=self.shape).astype(self.dtype)


class Discrete(Space):
    def __init__(self, n, seed=None):
        super().__init__((), np.int64, seed)
        self.n = n

    def sample(self):
        return np.int64(self.np_random.integers(self.n))

