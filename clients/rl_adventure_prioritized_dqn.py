"""higgsfield/RL-Adventure ``4.prioritized dqn.ipynb``: DQN with a proportional prioritized replay
buffer on CartPole-v0. ``NaivePrioritizedBuffer`` (a Python list of ``(state, action, reward,
next_state, done)`` with ``np.expand_dims``'d states and a float32 numpy ``priorities`` array;
``push`` gives a new transition ``priorities.max()``; ``sample(batch_size, beta)`` takes
``prios ** prob_alpha`` normalised, ``np.random.choice(len(buffer), batch_size, p=probs)``, the
importance weights ``(total * probs[indices]) ** (-beta)`` over their max as float32, and
``zip(*samples)`` into concatenated states / tuples of actions, rewards, dones;
``update_priorities(indices, prios)`` writes the array element by element). ``DQN``: a
4-128-128-2 ReLU MLP; ``act`` is epsilon-greedy (``random.random()``, ``random.randrange``). The
step is the notebook's ``compute_td_loss(batch_size, beta)`` as written: the
``replay_buffer.sample(batch_size, beta)`` inside it, ``Variable(torch.FloatTensor(...))`` of the
numpy arrays and tuples, ``current_model(state)`` / ``target_model(next_state)``, ``gather``,
``next_q_values.max(1)[0]``, ``expected_q_value = reward + gamma * next_q_value * (1 - done)``,
``loss = (q_value - expected_q_value.detach()).pow(2) * weights``, ``prios = loss + 1e-5``,
``loss = loss.mean()``, ``optimizer.zero_grad()``, ``loss.backward()``,
``replay_buffer.update_priorities(indices, prios.data.cpu().numpy())``, ``optimizer.step()``,
``return loss``. Adam with its default lr; ``update_target`` (``load_state_dict``) every
``1000`` frames outside the step; ``beta_by_frame`` and ``epsilon_by_frame`` as the notebook.

What a user of stepgraph changes: ``compute_td_loss`` is decorated (``sg.compile``, =
``@stepgraph.compile`` above its ``def``). Deviations: the notebook is Python 2 / torch 0.3 era:
``zip(*samples)`` is ``list(zip(*samples))`` (a zip object cannot be indexed in Python 3),
``losses.append(loss.data[0])`` is ``loss.item()`` (a 0-dim tensor cannot be indexed),
``q_value.max(1)[1].data[0]`` in ``act`` is kept (a 0-dim tensor; ``Variable(..., volatile=True)``
only warns); ``plot`` (matplotlib, every 200 frames) is left out, the losses are ``sg.log``-ed.
Scaled down / replaced: gym's CartPole-v0 is ``CartPole``, the cart-pole equations on numpy with
a seeded generator and gym < 0.26's API (``reset() -> obs``, ``step() -> (obs, reward, done,
info)``, 200-step episodes); batch_size 32 -> 8, capacity 100000 -> 1000, ``update_target`` every
1000 -> 4 frames (so it runs between the steps), ``steps`` counts ``compute_td_loss`` calls.

Source: https://github.com/higgsfield/RL-Adventure/blob/0f82b6922e8a1a8515fc4c84c28702e7caa226f1/4.prioritized%20dqn.ipynb
(no licence file in the repository; the corpus restates it, not copies it). Restated after the
source: same classes, names, ops and order.
"""
import math
import random

import numpy as np
import torch
import torch.autograd as autograd
import torch.nn as nn
import torch.optim as optim

SOURCE = "https://github.com/higgsfield/RL-Adventure/blob/0f82b6922e8a1a8515fc4c84c28702e7caa226f1/4.prioritized%20dqn.ipynb"
LICENSE = "none stated"
DEVICES = ("cpu",)   # (USE_CUDA picks .cuda(); the corpus runs the notebook's CPU path)
TAGS = ("rl", "dqn", "prioritized-replay", "numpy-random-in-step", "sample-in-step", "numpy-to-tensor-in-step",
        "tensor-to-numpy-in-step", "importance-weights", "target-network", "variable-wrapper", "adam")

USE_CUDA = False
Variable = lambda *args, **kwargs: autograd.Variable(*args, **kwargs).cuda() if USE_CUDA else autograd.Variable(*args, **kwargs)  # noqa: E731


class CartPole:
    """Stands in for ``gym.make('CartPole-v0')`` (gym < 0.26 API, 200-step episodes)."""

    max_episode_steps = 200

    class observation_space:
        shape = (4,)

    class action_space:
        n = 2

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def reset(self):
        self.state = self.rng.uniform(-0.05, 0.05, size=4)
        self.t = 0
        return self.state.astype(np.float32)

    def step(self, action):
        gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
        total_mass, polemass_length = masscart + masspole, masspole * length
        x, x_dot, theta, theta_dot = self.state
        force = force_mag if action == 1 else -force_mag
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + polemass_length * theta_dot ** 2 * sintheta) / total_mass
        thetaacc = (gravity * sintheta - costheta * temp) / (length * (4.0 / 3.0 - masspole * costheta ** 2 / total_mass))
        xacc = temp - polemass_length * thetaacc * costheta / total_mass
        x, x_dot = x + tau * x_dot, x_dot + tau * xacc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        self.state = np.array([x, x_dot, theta, theta_dot])
        self.t += 1
        done = bool(abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360 or self.t >= self.max_episode_steps)
        return self.state.astype(np.float32), 1.0, done, {}


class NaivePrioritizedBuffer(object):
    def __init__(self, capacity, prob_alpha=0.6):
        self.prob_alpha = prob_alpha
        self.capacity = capacity
        self.buffer = []
        self.pos = 0
        self.priorities = np.zeros((capacity,), dtype=np.float32)

    def push(self, state, action, reward, next_state, done):
        assert state.ndim == next_state.ndim
        state = np.expand_dims(state, 0)
        next_state = np.expand_dims(next_state, 0)
        max_prio = self.priorities.max() if self.buffer else 1.0
        if len(self.buffer) < self.capacity:
            self.buffer.append((state, action, reward, next_state, done))
        else:
            self.buffer[self.pos] = (state, action, reward, next_state, done)
        self.priorities[self.pos] = max_prio
        self.pos = (self.pos + 1) % self.capacity

    def sample(self, batch_size, beta=0.4):
        if len(self.buffer) == self.capacity:
            prios = self.priorities
        else:
            prios = self.priorities[:self.pos]
        probs = prios ** self.prob_alpha
        probs /= probs.sum()
        indices = np.random.choice(len(self.buffer), batch_size, p=probs)
        samples = [self.buffer[idx] for idx in indices]
        total = len(self.buffer)
        weights = (total * probs[indices]) ** (-beta)
        weights /= weights.max()
        weights = np.array(weights, dtype=np.float32)
        batch = list(zip(*samples))
        states = np.concatenate(batch[0])
        actions = batch[1]
        rewards = batch[2]
        next_states = np.concatenate(batch[3])
        dones = batch[4]
        return states, actions, rewards, next_states, dones, indices, weights

    def update_priorities(self, batch_indices, batch_priorities):
        for idx, prio in zip(batch_indices, batch_priorities):
            self.priorities[idx] = prio

    def __len__(self):
        return len(self.buffer)


beta_start = 0.4
beta_frames = 1000
beta_by_frame = lambda frame_idx: min(1.0, beta_start + frame_idx * (1.0 - beta_start) / beta_frames)  # noqa: E731

epsilon_start = 1.0
epsilon_final = 0.01
epsilon_decay = 500
epsilon_by_frame = lambda frame_idx: epsilon_final + (epsilon_start - epsilon_final) * math.exp(-1. * frame_idx / epsilon_decay)  # noqa: E731

env = CartPole(seed=0)


class DQN(nn.Module):
    def __init__(self, num_inputs, num_actions):
        super(DQN, self).__init__()
        self.layers = nn.Sequential(
            nn.Linear(env.observation_space.shape[0], 128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, env.action_space.n)
        )

    def forward(self, x):
        return self.layers(x)

    def act(self, state, epsilon):
        if random.random() > epsilon:
            state = Variable(torch.FloatTensor(state).unsqueeze(0), volatile=True)
            q_value = self.forward(state)
            action = q_value.max(1)[1].data[0]
        else:
            action = random.randrange(env.action_space.n)
        return action


def update_target(current_model, target_model):
    target_model.load_state_dict(current_model.state_dict())


batch_size = 8    # 32
gamma = 0.99
current_model = target_model = optimizer = replay_buffer = None


def compute_td_loss(batch_size, beta):
    state, action, reward, next_state, done, indices, weights = replay_buffer.sample(batch_size, beta)

    state = Variable(torch.FloatTensor(np.float32(state)))
    next_state = Variable(torch.FloatTensor(np.float32(next_state)))
    action = Variable(torch.LongTensor(action))
    reward = Variable(torch.FloatTensor(reward))
    done = Variable(torch.FloatTensor(done))
    weights = Variable(torch.FloatTensor(weights))

    q_values = current_model(state)
    next_q_values = target_model(next_state)

    q_value = q_values.gather(1, action.unsqueeze(1)).squeeze(1)
    next_q_value = next_q_values.max(1)[0]
    expected_q_value = reward + gamma * next_q_value * (1 - done)

    loss = (q_value - expected_q_value.detach()).pow(2) * weights
    prios = loss + 1e-5
    loss = loss.mean()

    optimizer.zero_grad()
    loss.backward()
    replay_buffer.update_priorities(indices, prios.data.cpu().numpy())
    optimizer.step()

    return loss


def main(sg, steps=8, device="cpu", amp=None):
    global current_model, target_model, optimizer, replay_buffer, compute_td_loss
    compute_td_loss = sg.compile(compute_td_loss)   # = @stepgraph.compile above ``def compute_td_loss``

    current_model = DQN(env.observation_space.shape[0], env.action_space.n)
    target_model = DQN(env.observation_space.shape[0], env.action_space.n)
    optimizer = optim.Adam(current_model.parameters())
    replay_buffer = NaivePrioritizedBuffer(1000)   # 100000
    update_target(current_model, target_model)
    sg.track(current_model=current_model, target_model=target_model, optimizer=optimizer)

    losses = []
    all_rewards = []
    episode_reward = 0
    trained = 0

    state = env.reset()
    for frame_idx in range(1, 10000 + 1):
        epsilon = epsilon_by_frame(frame_idx)
        action = current_model.act(state, epsilon)

        next_state, reward, done, _ = env.step(action)
        replay_buffer.push(state, action, reward, next_state, done)

        state = next_state
        episode_reward += reward

        if done:
            state = env.reset()
            all_rewards.append(episode_reward)
            episode_reward = 0

        if len(replay_buffer) > batch_size:
            beta = beta_by_frame(frame_idx)
            loss = compute_td_loss(batch_size, beta)
            losses.append(loss.item())
            trained += 1
            sg.log((loss, torch.from_numpy(replay_buffer.priorities[:len(replay_buffer)].copy())))

        if frame_idx % 4 == 0:   # 1000
            update_target(current_model, target_model)
        if trained == steps:
            break
