# Restates the part of CleanRL's cleanrl_utils/buffers.py that its off-policy scripts use
# (``ReplayBuffer(...)``, ``.add``, ``.sample`` and the ``to_torch`` conversion):
#   https://github.com/vwxyzjn/cleanrl/blob/fe8d8a03c41a7ef5b523e2e354bd01c363e786bb/cleanrl_utils/buffers.py
# That file is CleanRL's copy of stable-baselines3's common/buffers.py
# (https://github.com/DLR-RM/stable-baselines3), MIT License, Copyright (c) 2019-2023 Antonin Raffin,
# Ashley Hill, Anssi Kanervisto, Maximilian Ernestus, Rinu Boney, Pavan Goli, and other
# contributors; CleanRL's own code: Copyright (c) 2019 CleanRL developers, MIT License (see LICENSE
# beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text.
#
# What is kept, because the corpus depends on it: the storage layout (``buffer_size // n_envs``
# rows of ``n_envs`` columns, float32 rewards/dones/timeouts, float64 actions stored as float32),
# ``sample`` drawing its row indices and then its env indices from numpy's *global* generator
# (``np.random.randint``, in that order), the ``done * (1 - timeout)`` column, and every field
# converted by ``to_torch`` with ``torch.tensor(array, device=...)`` (a copy), returned as the
# ``ReplayBufferSamples`` named tuple. What is left out: RolloutBuffer, the memory-optimised variant
# (``optimize_memory_usage``), MultiDiscrete/MultiBinary/Dict spaces, the psutil memory check.
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch as th

from clients.vendor.cleanrl import spaces  # (stands in for gymnasium.spaces)


class ReplayBufferSamples(NamedTuple):
    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor


def _obs_shape(space) -> tuple:
    # a Discrete observation is stored as one integer per transition
    return (1,) if isinstance(space, spaces.Discrete) else tuple(space.shape)


def _action_dim(space) -> int:
    if isinstance(space, spaces.Discrete):
        return 1
    if isinstance(space, spaces.Box):
        return int(np.prod(space.shape))
    raise NotImplementedError(f"{space} action space is not supported")


def _device(device) -> th.device:
    device = th.device("cuda" if device == "auto" else device)
    if device.type == "cuda" and not th.cuda.is_available():
        return th.device("cpu")
    return device


class ReplayBuffer:
    """A ring of transitions for off-policy learning (SAC, TD3, DQN), filled one vector-env step
    at a time and sampled uniformly."""

    def __init__(self, buffer_size: int, observation_space, action_space, device="auto",
                 n_envs: int = 1, handle_timeout_termination: bool = True):
        self.observation_space, self.action_space = observation_space, action_space
        self.device = _device(device)
        self.n_envs = n_envs
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.obs_shape = _obs_shape(observation_space)
        self.action_dim = _action_dim(action_space)
        self.handle_timeout_termination = handle_timeout_termination
        self.pos, self.full = 0, False

        rows = (self.buffer_size, self.n_envs)
        self.observations = np.zeros(rows + self.obs_shape, dtype=observation_space.dtype)
        self.next_observations = np.zeros(rows + self.obs_shape, dtype=observation_space.dtype)
        act_dtype = np.float32 if action_space.dtype == np.float64 else action_space.dtype
        self.actions = np.zeros(rows + (self.action_dim,), dtype=act_dtype)
        self.rewards = np.zeros(rows, dtype=np.float32)
        self.dones = np.zeros(rows, dtype=np.float32)
        self.timeouts = np.zeros(rows, dtype=np.float32)

    def size(self) -> int:
        return self.buffer_size if self.full else self.pos

    def add(self, obs, next_obs, action, reward, done, infos) -> None:
        if isinstance(self.observation_space, spaces.Discrete):
            obs = obs.reshape((self.n_envs,) + self.obs_shape)
            next_obs = next_obs.reshape((self.n_envs,) + self.obs_shape)
        row = self.pos
        # np.array(...) copies: the caller may reuse its arrays
        self.observations[row] = np.array(obs)
        self.next_observations[row] = np.array(next_obs)
        self.actions[row] = np.array(action.reshape((self.n_envs, self.action_dim)))
        self.rewards[row] = np.array(reward)
        self.dones[row] = np.array(done)
        if self.handle_timeout_termination:
            self.timeouts[row] = np.array([info.get("TimeLimit.truncated", False) for info in infos])
        self.pos = row + 1
        if self.pos == self.buffer_size:
            self.pos, self.full = 0, True

    def sample(self, batch_size: int) -> ReplayBufferSamples:
        rows = np.random.randint(0, self.size(), size=batch_size)
        cols = np.random.randint(0, high=self.n_envs, size=(len(rows),))
        # a done caused by a time limit is not a terminal state (timeouts stay 0 unless handled)
        not_timeout = 1 - self.timeouts[rows, cols]
        fields = (
            self.observations[rows, cols, :],
            self.actions[rows, cols, :],
            self.next_observations[rows, cols, :],
            (self.dones[rows, cols] * not_timeout).reshape(-1, 1),
            self.rewards[rows, cols].reshape(-1, 1),
        )
        return ReplayBufferSamples(*(self.to_torch(f) for f in fields))

    def to_torch(self, array: np.ndarray, copy: bool = True) -> th.Tensor:
        """The numpy field as a tensor on the buffer's device; a copy unless ``copy=False``."""
        if copy:
            return th.tensor(array, device=self.device)
        return th.as_tensor(array, device=self.device)
