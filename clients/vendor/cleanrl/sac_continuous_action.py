# Restates SoftQNetwork, LOG_STD_MIN/LOG_STD_MAX and Actor of CleanRL's sac_continuous_action.py:
#   https://github.com/vwxyzjn/cleanrl/blob/fe8d8a03c41a7ef5b523e2e354bd01c363e786bb/cleanrl/sac_continuous_action.py
# Copyright (c) 2019 CleanRL developers. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. Same layers created in the same order, the same attribute and buffer names
# (fc1, fc2, fc3; fc1, fc2, fc_mean, fc_logstd, action_scale, action_bias) and the same tensor ops
# in the same order in forward/get_action. The script itself is in clients/cleanrl_sac.py.
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

LOG_STD_MAX = 2
LOG_STD_MIN = -5


def _numel(space):
    return int(np.prod(space.shape))


def _rescaling(module, space):
    """Buffers mapping tanh's [-1, 1] onto the Box [low, high]: half its width, its midpoint."""
    half_width = (space.high - space.low) / 2.0
    midpoint = (space.high + space.low) / 2.0
    module.register_buffer("action_scale", torch.tensor(half_width, dtype=torch.float32))
    module.register_buffer("action_bias", torch.tensor(midpoint, dtype=torch.float32))


class SoftQNetwork(nn.Module):
    """Q(s, a): the observation and action concatenated, two hidden layers of 256."""

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
    """Gaussian policy squashed by tanh; the log-std is squashed into [LOG_STD_MIN, LOG_STD_MAX]."""

    def __init__(self, env):
        super().__init__()
        n_obs, n_act = _numel(env.single_observation_space), _numel(env.single_action_space)
        self.fc1 = nn.Linear(n_obs, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc_mean = nn.Linear(256, n_act)
        self.fc_logstd = nn.Linear(256, n_act)
        _rescaling(self, env.single_action_space)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        mean = self.fc_mean(h)
        squashed = torch.tanh(self.fc_logstd(h))
        # affine map of tanh's (-1, 1) onto (LOG_STD_MIN, LOG_STD_MAX)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (squashed + 1)
        return mean, log_std

    def get_action(self, x):
        """(sampled action, its log-probability summed over action dims, deterministic action)."""
        mean, log_std = self(x)
        dist = torch.distributions.Normal(mean, log_std.exp())
        u = dist.rsample()                      # reparameterised: mean + std * eps
        squashed = torch.tanh(u)
        action = squashed * self.action_scale + self.action_bias
        logp = dist.log_prob(u)
        # change of variables through tanh and the rescaling (1e-6 keeps the log finite)
        logp -= torch.log(self.action_scale * (1 - squashed.pow(2)) + 1e-6)
        logp = logp.sum(1, keepdim=True)
        greedy = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, logp, greedy
