# Restates QNetwork and Actor of CleanRL's td3_continuous_action.py:
#   https://github.com/vwxyzjn/cleanrl/blob/fe8d8a03c41a7ef5b523e2e354bd01c363e786bb/cleanrl/td3_continuous_action.py
# Copyright (c) 2019 CleanRL developers. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. Same layers created in the same order, the same attribute and buffer names
# (fc1, fc2, fc3; fc1, fc2, fc_mu, action_scale, action_bias) and the same ops in forward. The
# script itself is in clients/cleanrl_td3.py.
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def _numel(space):
    return int(np.prod(space.shape))


class QNetwork(nn.Module):
    """Q(s, a) on the concatenated observation and action: 256 -> 256 -> 1."""

    def __init__(self, env):
        super().__init__()
        n_in = _numel(env.single_observation_space) + _numel(env.single_action_space)
        self.fc1 = nn.Linear(n_in, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 1)

    def forward(self, x, a):
        h = torch.cat([x, a], 1)
        h = F.relu(self.fc1(h))
        h = F.relu(self.fc2(h))
        return self.fc3(h)


class Actor(nn.Module):
    """Deterministic policy: tanh output rescaled from [-1, 1] onto the action Box."""

    def __init__(self, env):
        super().__init__()
        box = env.single_action_space
        self.fc1 = nn.Linear(_numel(env.single_observation_space), 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc_mu = nn.Linear(256, _numel(box))
        self.register_buffer("action_scale", torch.tensor((box.high - box.low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((box.high + box.low) / 2.0, dtype=torch.float32))

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        return torch.tanh(self.fc_mu(h)) * self.action_scale + self.action_bias
