"""pytorch/examples reinforcement_learning/reinforce.py: REINFORCE on CartPole. ``select_action``
runs the policy (with dropout) once per environment step *outside* the training step, sampling a
``Categorical`` and appending ``m.log_prob(action)`` to ``policy.saved_log_probs`` (a plain list on
the module); the environment's rewards go to ``policy.rewards`` (Python floats). ``finish_episode()``
is the step: discounted returns from ``policy.rewards`` in Python floats (a ``deque``),
``torch.tensor(returns)``, normalisation with ``eps``, the loss over the saved log probs (whose
autograd graphs were built before the step was called), ``optimizer.zero_grad()``, ``backward()``,
``optimizer.step()``, then ``del policy.rewards[:]`` / ``del policy.saved_log_probs[:]``. It takes
no arguments and returns nothing: everything flows through module globals and the module's lists.

Model: vendor/pytorch_examples/reinforcement_learning_reinforce.py (``class Policy``, verbatim).
Loop: reinforce.py lines 48-96 (module globals ``policy``, ``optimizer``, ``eps``, ``args``;
``select_action``, ``finish_episode`` and ``main()``'s episode loop as written; ``steps`` = episodes).
Scaled down / replaced: gymnasium's CartPole-v1 is replaced by ``CartPole``, a few lines of the same
cart-pole dynamics on numpy with its own seeded generator, truncating episodes at 10 steps instead
of 500, and whose per-step reward is drawn from that generator instead of CartPole's constant 1.0
(so that the returns differ from episode to episode). No printing, no rendering. reinforce.py is
CPU-only (``torch.from_numpy`` states): ``device`` is not used.
"""
from collections import deque
from itertools import count

import numpy as np
import torch
import torch.optim as optim
from torch.distributions import Categorical

from clients.vendor.pytorch_examples.reinforcement_learning_reinforce import Policy

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/reinforcement_learning/reinforce.py"
LICENSE = "BSD-3-Clause"
DEVICES = ("cpu",)  # states come from numpy on the CPU, as in the original
TAGS = ("rl", "policy-gradient", "adam", "module-lists", "graph-built-outside-step", "python-floats",
        "no-args-step")


class args:  # argparse defaults of reinforce.py
    gamma = 0.99; seed = 543; render = False; log_interval = 10


class CartPole:
    """Stands in for ``gym.make('CartPole-v1')``: cart-pole dynamics, a seeded generator, short
    episodes, random (deterministic given the seed) rewards."""

    class spec:
        reward_threshold = 475.0

    max_episode_steps = 10

    def reset(self, seed=None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
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
        terminated = bool(abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360)
        truncated = self.t >= self.max_episode_steps
        reward = float(self.rng.uniform(0.5, 1.5))
        return self.state.astype(np.float32), reward, terminated, truncated, {}


env = None
policy = None
optimizer = None
eps = np.finfo(np.float32).eps.item()
finish_episode = None


def select_action(state):
    state = torch.from_numpy(state).float().unsqueeze(0)
    probs = policy(state)
    m = Categorical(probs)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def main(sg, steps=8, device="cpu", amp=None):
    global env, policy, optimizer, finish_episode
    env = CartPole()
    env.reset(seed=args.seed)
    policy = Policy()
    optimizer = optim.Adam(policy.parameters(), lr=1e-2)
    sg.track(policy=policy, optimizer=optimizer)

    @sg.compile
    def finish_episode():
        R = 0
        policy_loss = []
        returns = deque()
        for r in policy.rewards[::-1]:
            R = r + args.gamma * R
            returns.appendleft(R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)
        for log_prob, R in zip(policy.saved_log_probs, returns):
            policy_loss.append(-log_prob * R)
        optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        policy_loss.backward()
        optimizer.step()
        del policy.rewards[:]
        del policy.saved_log_probs[:]

    running_reward = 10
    for i_episode in count(1):
        state, _ = env.reset()
        ep_reward = 0
        for t in range(1, 10000):  # Don't infinite loop while learning
            action = select_action(state)
            state, reward, terminated, truncated, _ = env.step(action)
            policy.rewards.append(reward)
            ep_reward += reward
            if terminated or truncated:
                break

        running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
        finish_episode()
        sg.log((t, ep_reward, running_reward))  # what reinforce.py prints every log_interval episodes
        if running_reward > env.spec.reward_threshold:
            break  # "Solved!"
        if i_episode == steps:
            break
