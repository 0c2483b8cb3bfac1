# Vendored verbatim from pytorch/tutorials, intermediate_source/reinforcement_q_learning.py
# (https://github.com/pytorch/tutorials/blob/main/intermediate_source/reinforcement_q_learning.py,
# the "Reinforcement Learning (DQN) Tutorial" by Adam Paszke and Mark Towers, CartPole-v1 /
# gymnasium / AdamW-amsgrad / soft target update version, as published in 2024). That repository
# is too large for this project's mirror, so the text was taken from the notebook pytorch.org
# serves for download, committed unmodified at
# https://github.com/Timoniche/KANDQN/blob/4429d6a93253d0864a1fcba2ceed6dbdb12b1c84/PytorchDQN/reinforcement_q_learning.ipynb
# Copyright (c) 2017-2022, Pytorch contributors. BSD 3-Clause License (see LICENSE beside this file).
# Only the imports these need, `Transition`, `class ReplayMemory` and `class DQN` are kept,
# unedited. The tutorial's gymnasium env, hyper-parameters, select_action, plot_durations,
# optimize_model and episode loop are cut (the client reproduces them).
import random
from collections import namedtuple, deque

import torch.nn as nn
import torch.nn.functional as F


Transition = namedtuple('Transition',
                        ('state', 'action', 'next_state', 'reward'))


class ReplayMemory(object):

    def __init__(self, capacity):
        self.memory = deque([], maxlen=capacity)

    def push(self, *args):
        """Save a transition"""
        self.memory.append(Transition(*args))

    def sample(self, batch_size):
        return random.sample(self.memory, batch_size)

    def __len__(self):
        return len(self.memory)


class DQN(nn.Module):

    def __init__(self, n_observations, n_actions):
        super(DQN, self).__init__()
        self.layer1 = nn.Linear(n_observations, 128)
        self.layer2 = nn.Linear(128, 128)
        self.layer3 = nn.Linear(128, n_actions)

    # Called with either one element to determine next action, or a batch
    # during optimization. Returns tensor([[left0exp,right0exp]...]).
    def forward(self, x):
        x = F.relu(self.layer1(x))
        x = F.relu(self.layer2(x))
        return self.layer3(x)
