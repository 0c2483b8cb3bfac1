"""seungeunrho/minimalRL's dqn.py: DQN on CartPole-v1 in one file. ``Qnet`` (a 4-128-128-2 MLP)
and its target copy ``q_target`` (``load_state_dict(q.state_dict())`` at the start and every
``print_interval`` episodes, outside the step); a ``ReplayBuffer`` over a
``collections.deque(maxlen=buffer_limit)`` of ``(s, a, r/100.0, s_prime, done_mask)`` tuples
whose ``sample(n)`` draws ``random.sample(self.buffer, n)`` and builds the batch with
``torch.tensor`` of Python lists (numpy observations, ints, floats); ``Qnet.sample_action``
runs the net, then ``random.random()`` against epsilon, ``random.randint(0, 1)`` or
``out.argmax().item()``. The step is ``train(q, q_target, memory, optimizer)`` as dqn.py writes
it: 10 minibatches, each ``memory.sample(batch_size)`` (inside the step, as in the source),
``q(s).gather(1, a)``, ``q_target(s_prime).max(1)[0].unsqueeze(1)``, the TD target with
``done_mask``, ``F.smooth_l1_loss``, ``zero_grad`` / ``backward`` / Adam ``step``.

What a user of stepgraph changes: ``train`` is decorated (``train = sg.compile(train)`` at the
start of ``main``, the same as ``@stepgraph.compile`` above ``def train``). Everything else is
dqn.py's ``main()`` as written. Scaled down / replaced: gym's CartPole-v1 is replaced by
``CartPole``, the cart-pole dynamics on numpy with its own seeded generator (reward 1.0,
termination as CartPole's, gym >= 0.26's 5-tuple, which dqn.py unpacks); training starts once
the memory holds more than 200 transitions (2000) and ``print_interval`` is 2 (20), so the
target copy runs between the 8 ``train`` calls; the print is kept as ``sg.log`` of the average
score and the buffer size; ``steps`` counts ``train`` calls. Sizes and hyper-parameters are
dqn.py's.

Source: https://github.com/seungeunrho/minimalRL/blob/c8efed8481e3cd40e9739cfde220a55522555b57/dqn.py
(MIT License, Copyright (c) 2019 seungeunrho). Restated after the source, not copied: same
modules, names, ops, initialisation and semantics.
"""
import collections
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

SOURCE = "https://github.com/seungeunrho/minimalRL/blob/c8efed8481e3cd40e9739cfde220a55522555b57/dqn.py"
LICENSE = "MIT"
DEVICES = ("cpu",)  # dqn.py is CPU-only (torch.from_numpy states, tensors built on the CPU)
TAGS = ("rl", "dqn", "replay-buffer", "deque", "python-random", "sample-in-step", "tensor-from-list",
        "target-network", "load-state-dict-between-steps", "inner-loop-in-step", "smooth-l1")

# Hyperparameters (dqn.py's)
learning_rate = 0.0005
gamma = 0.98
buffer_limit = 50000
batch_size = 32


class CartPole:
    """Stands in for ``gym.make('CartPole-v1')``: the cart-pole equations on numpy, a seeded
    generator for the initial state, gym >= 0.26's ``reset() -> (obs, info)`` and
    ``step() -> (obs, reward, terminated, truncated, info)``."""

    max_episode_steps = 500

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

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
        terminated = bool(abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360)
        truncated = self.t >= self.max_episode_steps
        return self.state.astype(np.float32), 1.0, terminated, truncated, {}

    def close(self):
        pass


class ReplayBuffer():
    def __init__(self):
        self.buffer = collections.deque(maxlen=buffer_limit)

    def put(self, transition):
        self.buffer.append(transition)

    def sample(self, n):
        mini_batch = random.sample(self.buffer, n)
        s_lst, a_lst, r_lst, s_prime_lst, done_mask_lst = [], [], [], [], []
        for s, a, r, s_prime, done_mask in mini_batch:
            s_lst.append(s)
            a_lst.append([a])
            r_lst.append([r])
            s_prime_lst.append(s_prime)
            done_mask_lst.append([done_mask])
        return (torch.tensor(s_lst, dtype=torch.float), torch.tensor(a_lst),
                torch.tensor(r_lst), torch.tensor(s_prime_lst, dtype=torch.float),
                torch.tensor(done_mask_lst))

    def size(self):
        return len(self.buffer)


class Qnet(nn.Module):
    def __init__(self):
        super(Qnet, self).__init__()
        self.fc1 = nn.Linear(4, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 2)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        return self.fc3(h)

    def sample_action(self, obs, epsilon):
        out = self.forward(obs)
        coin = random.random()
        if coin < epsilon:
            return random.randint(0, 1)
        return out.argmax().item()


def train(q, q_target, memory, optimizer):
    for i in range(10):
        s, a, r, s_prime, done_mask = memory.sample(batch_size)

        q_out = q(s)
        q_a = q_out.gather(1, a)
        max_q_prime = q_target(s_prime).max(1)[0].unsqueeze(1)
        target = r + gamma * max_q_prime * done_mask
        loss = F.smooth_l1_loss(q_a, target)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main(sg, steps=8, device="cpu", amp=None):
    global train
    train = sg.compile(train)   # = @stepgraph.compile above ``def train``

    env = CartPole(seed=0)
    q = Qnet()
    q_target = Qnet()
    q_target.load_state_dict(q.state_dict())
    memory = ReplayBuffer()

    print_interval = 2   # 20
    score = 0.0
    optimizer = optim.Adam(q.parameters(), lr=learning_rate)
    sg.track(q=q, q_target=q_target, optimizer=optimizer)
    trained = 0

    for n_epi in range(10000):
        epsilon = max(0.01, 0.08 - 0.01 * (n_epi / 200))  # linear annealing from 8% to 1%
        s, _ = env.reset()
        done = False

        while not done:
            a = q.sample_action(torch.from_numpy(s).float(), epsilon)
            s_prime, r, done, truncated, info = env.step(a)
            done_mask = 0.0 if done else 1.0
            memory.put((s, a, r / 100.0, s_prime, done_mask))
            s = s_prime

            score += r
            if done:
                break

        if memory.size() > 200:   # 2000
            train(q, q_target, memory, optimizer)
            trained += 1

        if n_epi % print_interval == 0 and n_epi != 0:
            q_target.load_state_dict(q.state_dict())
            # print("n_episode :{}, score : {:.1f}, n_buffer : {}, eps : {:.1f}%")
            sg.log((n_epi, score / print_interval, memory.size(), epsilon * 100))
            score = 0.0
        if trained == steps:
            break
    env.close()
