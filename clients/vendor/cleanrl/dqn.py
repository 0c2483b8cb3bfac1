# Restates QNetwork and linear_schedule of CleanRL's dqn.py:
#   https://github.com/vwxyzjn/cleanrl/blob/fe8d8a03c41a7ef5b523e2e354bd01c363e786bb/cleanrl/dqn.py
# Copyright (c) 2019 CleanRL developers. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. Same layers in the same order (so the same parameter init draws), same
# attribute name (`network`), same forward; the script itself (Args, make_env, the loop) is in
# clients/cleanrl_dqn.py.
import numpy as np
import torch.nn as nn


def _flat_size(space):
    """Number of scalars in one observation of ``space``."""
    return int(np.prod(space.shape))


class QNetwork(nn.Module):
    """State -> one Q-value per discrete action: an MLP 120 -> 84 with ReLUs."""

    def __init__(self, env):
        super().__init__()
        n_in = _flat_size(env.single_observation_space)
        n_out = env.single_action_space.n
        self.network = nn.Sequential(
            nn.Linear(n_in, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, n_out),
        )

    def forward(self, x):
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    """Epsilon going linearly from ``start_e`` to ``end_e`` over ``duration`` steps, then flat."""
    rate = (end_e - start_e) / duration
    return max(rate * t + start_e, end_e)
