"""pytorch/examples reinforcement_learning/actor_critic.py: one-step actor-critic on CartPole, actor
and critic heads on one trunk. ``select_action`` runs the model once per environment step *outside*
the training step and appends ``SavedAction(log_prob, value)`` namedtuples to ``model.saved_actions``
(a plain list on the module); rewards go to ``model.rewards`` (Python floats). ``finish_episode()`` is
the step: discounted returns in Python floats, ``torch.tensor(returns)``, normalisation with ``eps``,
per saved action ``advantage = R - value.item()`` (a host read inside the step), the actor loss
``-log_prob * advantage`` and the critic loss ``F.smooth_l1_loss(value, torch.tensor([R]))`` (a new
tensor from a 0-d tensor), ``optimizer.zero_grad()``, ``torch.stack(...).sum()`` of both lists,
``backward()`` through graphs built before the step was called, ``optimizer.step()``, then
``del model.rewards[:]`` / ``del model.saved_actions[:]``. No arguments, no return value.

Model: vendor/pytorch_examples/reinforcement_learning_actor_critic.py (``SavedAction``,
``class Policy``, verbatim). Loop: actor_critic.py lines 72-172 (module globals ``model``,
``optimizer``, ``eps``, ``args``; ``select_action``, ``finish_episode`` and ``main()``'s episode loop
as written; ``steps`` = episodes). Scaled down / replaced: gymnasium's CartPole-v1 is replaced by
``CartPole``, a few lines of the same cart-pole dynamics on numpy with its own seeded generator,
truncating episodes at 10 steps instead of 500, and whose per-step reward is drawn from that
generator instead of CartPole's constant 1.0 (so that the returns differ from episode to episode).
No printing, no rendering. actor_critic.py is CPU-only (``torch.from_numpy`` states): ``device`` is
not used.
"""
from itertools import count

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.distributions import Categorical

from clients.vendor.pytorch_examples.reinforcement_learning_actor_critic import Policy, SavedAction

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/reinforcement_learning/actor_critic.py"
LICENSE = "BSD-3-Clause"
DEVICES = ("cpu",)  # states come from numpy on the CPU, as in the original
TAGS = ("rl", "actor-critic", "adam", "module-lists", "graph-built-outside-step", "python-floats",
        "item-in-step", "no-args-step", "namedtuple")


class args:  # argparse defaults of actor_critic.py
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
model = None
optimizer = None
eps = np.finfo(np.float32).eps.item()
finish_episode = None


def select_action(state):
    state = torch.from_numpy(state).float()
    probs, state_value = model(state)

    # create a categorical distribution over the list of probabilities of actions
    m = Categorical(probs)

    # and sample an action using the distribution
    action = m.sample()

    # save to action buffer
    model.saved_actions.append(SavedAction(m.log_prob(action), state_value))

    # the action to take (left or right)
    return action.item()


def main(sg, steps=8, device="cpu", amp=None):
    global env, model, optimizer, finish_episode
    env = CartPole()
    env.reset(seed=args.seed)
    model = Policy()
    optimizer = optim.Adam(model.parameters(), lr=3e-2)
    sg.track(model=model, optimizer=optimizer)

    @sg.compile
    def finish_episode():
        """
        Training code. Calculates actor and critic loss and performs backprop.
        """
        R = 0
        saved_actions = model.saved_actions
        policy_losses = [] # list to save actor (policy) loss
        value_losses = [] # list to save critic (value) loss
        returns = [] # list to save the true values

        # calculate the true value using rewards returned from the environment
        for r in model.rewards[::-1]:
            # calculate the discounted value
            R = r + args.gamma * R
            returns.insert(0, R)

        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)

        for (log_prob, value), R in zip(saved_actions, returns):
            advantage = R - value.item()

            # calculate actor (policy) loss
            policy_losses.append(-log_prob * advantage)

            # calculate critic (value) loss using L1 smooth loss
            value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))

        # reset gradients
        optimizer.zero_grad()

        # sum up all the values of policy_losses and value_losses
        loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()

        # perform backprop
        loss.backward()
        optimizer.step()

        # reset rewards and action buffer
        del model.rewards[:]
        del model.saved_actions[:]

    running_reward = 10

    # run infinitely many episodes
    for i_episode in count(1):

        # reset environment and episode reward
        state, _ = env.reset()
        ep_reward = 0

        # for each episode, only run 9999 steps so that we don't
        # infinite loop while learning
        for t in range(1, 10000):

            # select action from policy
            action = select_action(state)

            # take the action
            state, reward, terminated, truncated, _ = env.step(action)

            model.rewards.append(reward)
            ep_reward += reward
            if terminated or truncated:
                break

        # update cumulative reward
        running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward

        # perform backprop
        finish_episode()
        sg.log((t, ep_reward, running_reward))  # what actor_critic.py prints every log_interval episodes

        # check if we have "solved" the cart pole problem
        if running_reward > env.spec.reward_threshold:
            break  # "Solved!"
        if i_episode == steps:
            break
