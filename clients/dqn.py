"""PyTorch's DQN tutorial (intermediate_source/reinforcement_q_learning.py, the CartPole-v1 /
gymnasium version): a 3-layer MLP Q-network, a target network, a ``ReplayMemory`` (a ``deque``
sampled with ``random.sample``), epsilon-greedy ``select_action`` (Python ``random``), and
``optimize_model()`` as the step: ``Transition(*zip(*transitions))``, the non-final mask built
with ``torch.tensor(tuple(map(lambda s: s is not None, ...)), dtype=torch.bool)``, ``torch.cat`` of
the sampled per-transition tensors, ``policy_net(state_batch).gather(1, action_batch)``,
``next_state_values[non_final_mask] = target_net(non_final_next_states).max(1).values`` under
``no_grad``, ``nn.SmoothL1Loss``, ``optimizer.zero_grad()``, ``backward()``,
``torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)``, AdamW(amsgrad=True).step().
After every environment step, the soft target update as the tutorial writes it:
``target_net.state_dict()`` blended with ``policy_net.state_dict()`` by ``TAU`` in Python, then
``target_net.load_state_dict(...)`` (in place: the target's tensors keep their identity).

Model: vendor/pytorch_tutorials/reinforcement_q_learning.py (``Transition``, ``ReplayMemory``,
``DQN``, verbatim). Loop: the tutorial's hyper-parameter cell, ``select_action`` and its
training-loop cell, as written. One change, the one a user of stepgraph has to make: the step
is the tensor part of ``optimize_model``; its early return (``if len(memory) < BATCH_SIZE``) and
``memory.sample(BATCH_SIZE)`` (a host random draw, which a replay could not repeat) run at the
call site and the sampled ``transitions`` are the step's argument. Scaled down / replaced:
gymnasium's CartPole-v1 is replaced by ``CartPole``, a few lines of the same dynamics on numpy
with its own seeded generator (reward 1.0, termination as CartPole's, truncation at 500), and
``env.action_space.sample()`` draws from that generator; ``steps`` counts optimisation steps (the
first comes once the memory holds ``BATCH_SIZE`` = 128 transitions, as in the tutorial); no
plotting.
"""
import math
import random
from itertools import count

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

from clients.vendor.pytorch_tutorials.reinforcement_q_learning import DQN, ReplayMemory, Transition

SOURCE = "https://github.com/pytorch/tutorials/blob/main/intermediate_source/reinforcement_q_learning.py"
LICENSE = "BSD-3-Clause"
TAGS = ("rl", "dqn", "target-network", "replay-memory", "bool-mask-index-put", "clip-grad-value",
        "adamw-amsgrad", "load-state-dict-between-steps", "python-random")


class CartPole:
    """Stands in for ``gym.make("CartPole-v1")``: the cart-pole dynamics on numpy, a seeded
    generator for resets and ``action_space.sample()``."""

    class action_space:
        n = 2
        rng = None

        @classmethod
        def sample(cls):
            return int(cls.rng.integers(2))

    max_episode_steps = 500

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.action_space.rng = self.rng

    def reset(self):
        self.state = self.rng.uniform(-0.05, 0.05, size=4)
        self.t = 0
        return self.state.astype(np.float32), {}

    def step(self, action):
        gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
        total_mass, polemass_length = masscart + masspole, masspole * length
        x, x_dot, theta, theta_dot = self.state
        force = force_mag if action == 1 else -force_mag
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + polemass_length * theta_dot ** 2 * sintheta) / total_mass
        thetaacc = (gravity * sintheta - costheta * temp) / (
            length * (4.0 / 3.0 - masspole * costheta ** 2 / total_mass))
        xacc = temp - polemass_length * thetaacc * costheta / total_mass
        x, x_dot = x + tau * x_dot, x_dot + tau * xacc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        self.state = np.array([x, x_dot, theta, theta_dot])
        self.t += 1
        terminated = bool(abs(x) > 2.4 or abs(theta) > 12 * 2 * math.pi / 360)
        truncated = self.t >= self.max_episode_steps
        return self.state.astype(np.float32), 1.0, terminated, truncated, {}


# BATCH_SIZE is the number of transitions sampled from the replay buffer
# GAMMA is the discount factor as mentioned in the previous section
# EPS_START is the starting value of epsilon
# EPS_END is the final value of epsilon
# EPS_DECAY controls the rate of exponential decay of epsilon, higher means a slower decay
# TAU is the update rate of the target network
# LR is the learning rate of the ``AdamW`` optimizer
BATCH_SIZE = 128
GAMMA = 0.99
EPS_START = 0.9
EPS_END = 0.05
EPS_DECAY = 1000
TAU = 0.005
LR = 1e-4


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    env = CartPole(seed=0)

    # Get number of actions from gym action space
    n_actions = env.action_space.n
    # Get the number of state observations
    state, info = env.reset()
    n_observations = len(state)

    policy_net = DQN(n_observations, n_actions).to(device)
    target_net = DQN(n_observations, n_actions).to(device)
    target_net.load_state_dict(policy_net.state_dict())

    optimizer = optim.AdamW(policy_net.parameters(), lr=LR, amsgrad=True)
    memory = ReplayMemory(10000)
    sg.track(policy_net=policy_net, target_net=target_net, optimizer=optimizer)

    steps_done = 0

    def select_action(state):
        nonlocal steps_done
        sample = random.random()
        eps_threshold = EPS_END + (EPS_START - EPS_END) * \
            math.exp(-1. * steps_done / EPS_DECAY)
        steps_done += 1
        if sample > eps_threshold:
            with torch.no_grad():
                # t.max(1) will return the largest column value of each row.
                # second column on max result is index of where max element was
                # found, so we pick action with the larger expected reward.
                return policy_net(state).max(1).indices.view(1, 1)
        else:
            return torch.tensor([[env.action_space.sample()]], device=device, dtype=torch.long)

    episode_durations = []

    @sg.compile
    def optimize_model(transitions):
        # Transpose the batch (see https://stackoverflow.com/a/19343/3343043 for
        # detailed explanation). This converts batch-array of Transitions
        # to Transition of batch-arrays.
        batch = Transition(*zip(*transitions))

        # Compute a mask of non-final states and concatenate the batch elements
        # (a final state would've been the one after which simulation ended)
        non_final_mask = torch.tensor(tuple(map(lambda s: s is not None,
                                              batch.next_state)), device=device, dtype=torch.bool)
        non_final_next_states = torch.cat([s for s in batch.next_state
                                                    if s is not None])
        state_batch = torch.cat(batch.state)
        action_batch = torch.cat(batch.action)
        reward_batch = torch.cat(batch.reward)

        # Compute Q(s_t, a) - the model computes Q(s_t), then we select the
        # columns of actions taken. These are the actions which would've been taken
        # for each batch state according to policy_net
        state_action_values = policy_net(state_batch).gather(1, action_batch)

        # Compute V(s_{t+1}) for all next states.
        # Expected values of actions for non_final_next_states are computed based
        # on the "older" target_net; selecting their best reward with max(1).values
        # This is merged based on the mask, such that we'll have either the expected
        # state value or 0 in case the state was final.
        next_state_values = torch.zeros(BATCH_SIZE, device=device)
        with torch.no_grad():
            next_state_values[non_final_mask] = target_net(non_final_next_states).max(1).values
        # Compute the expected Q values
        expected_state_action_values = (next_state_values * GAMMA) + reward_batch

        # Compute Huber loss
        criterion = nn.SmoothL1Loss()
        loss = criterion(state_action_values, expected_state_action_values.unsqueeze(1))

        # Optimize the model
        optimizer.zero_grad()
        loss.backward()
        # In-place gradient clipping
        torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
        optimizer.step()

    optimized = 0
    num_episodes = 50
    for i_episode in range(num_episodes):
        # Initialize the environment and get its state
        state, info = env.reset()
        state = torch.tensor(state, dtype=torch.float32, device=device).unsqueeze(0)
        for t in count():
            action = select_action(state)
            observation, reward, terminated, truncated, _ = env.step(action.item())
            reward = torch.tensor([reward], device=device)
            done = terminated or truncated

            if terminated:
                next_state = None
            else:
                next_state = torch.tensor(observation, dtype=torch.float32, device=device).unsqueeze(0)

            # Store the transition in memory
            memory.push(state, action, next_state, reward)

            # Move to the next state
            state = next_state

            # Perform one step of the optimization (on the policy network): optimize_model's
            # early return and its memory.sample(BATCH_SIZE), outside the step
            if len(memory) >= BATCH_SIZE:
                optimize_model(memory.sample(BATCH_SIZE))
                optimized += 1

            # Soft update of the target network's weights
            # θ′ ← τ θ + (1 −τ )θ′
            target_net_state_dict = target_net.state_dict()
            policy_net_state_dict = policy_net.state_dict()
            for key in policy_net_state_dict:
                target_net_state_dict[key] = policy_net_state_dict[key]*TAU + target_net_state_dict[key]*(1-TAU)
            target_net.load_state_dict(target_net_state_dict)

            if optimized == steps:
                sg.log(episode_durations)  # what the tutorial plots
                return
            if done:
                episode_durations.append(t + 1)
                break
