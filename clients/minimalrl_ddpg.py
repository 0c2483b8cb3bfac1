"""seungeunrho/minimalRL's ddpg.py: DDPG on Pendulum-v1 in one file. An actor ``MuNet`` (3-128-64-1,
``tanh(...) * 2``), a critic ``QNet`` (state and action embedded apart by ``fc_s`` / ``fc_a``,
``torch.cat``, two more layers), target copies of both (``load_state_dict`` at the start), two
Adams (``lr_mu``, ``lr_q``), a ``ReplayBuffer`` over a ``collections.deque`` whose ``sample(n)``
draws ``random.sample(self.buffer, n)`` and builds float tensors from Python lists, and the
exploration noise ``OrnsteinUhlenbeckNoise`` on numpy (``np.random.normal``), added to
``mu(s).item()`` outside the step. ``train(mu, mu_target, q, q_target, memory, q_optimizer,
mu_optimizer)``: ``memory.sample(batch_size)`` (inside, as in the source), the target
``r + gamma * q_target(s', mu_target(s')) * done_mask``, ``F.smooth_l1_loss(q(s, a),
target.detach())`` and the critic's Adam step, then ``-q(s, mu(s)).mean()`` and the actor's
Adam step (its backward also fills the critic's grads, which the next ``zero_grad`` clears);
``soft_update(net, net_target)``:
``param_target.data.copy_(param_target.data * (1.0 - tau) + param.data * tau)``. The step is
the block the program runs once the memory is full enough, as written:
``for i in range(10): train(...); soft_update(mu, mu_target); soft_update(q, q_target)``.

What a user of stepgraph changes: that block is indented into ``train_block()`` under
``@sg.compile`` (a closure over main's nets, optimizers and memory). Everything else is ddpg.py's
``main()`` as written. Scaled down / replaced: gym's Pendulum-v1 (``max_episode_steps=200,
autoreset=True``) is replaced by ``Pendulum``, Pendulum-v1's equations on numpy with its own
seeded generator for the initial state (never terminates; the 5-tuple of gym >= 0.26);
episodes are 50 steps (``count < 50``; 200), training starts once the memory holds more than
200 transitions (2000) and ``print_interval`` is 2 (20; the print is kept as ``sg.log`` of the
average score); ``steps`` counts ``train_block`` calls. Sizes and hyper-parameters are
ddpg.py's.

Source: https://github.com/seungeunrho/minimalRL/blob/c8efed8481e3cd40e9739cfde220a55522555b57/ddpg.py
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

SOURCE = "https://github.com/seungeunrho/minimalRL/blob/c8efed8481e3cd40e9739cfde220a55522555b57/ddpg.py"
LICENSE = "MIT"
DEVICES = ("cpu",)  # ddpg.py is CPU-only (torch.from_numpy states, tensors built on the CPU)
TAGS = ("rl", "ddpg", "actor-critic", "replay-buffer", "deque", "python-random", "sample-in-step",
        "tensor-from-list", "target-network", "soft-update-data-copy", "two-optimizers",
        "inner-loop-in-step", "ou-noise-numpy", "smooth-l1")

# Hyperparameters (ddpg.py's)
lr_mu = 0.0005
lr_q = 0.001
gamma = 0.99
batch_size = 32
buffer_limit = 50000
tau = 0.005  # for target network soft update


class Pendulum:
    """Stands in for ``gym.make('Pendulum-v1', max_episode_steps=..., autoreset=True)``:
    Pendulum-v1's equations on numpy, a seeded generator for the initial state, observations
    ``[cos th, sin th, thdot]`` in float32, reward ``-(angle^2 + .1 thdot^2 + .001 u^2)``."""

    max_speed, max_torque, dt, g, m, l = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0

    def __init__(self, seed=0, max_episode_steps=50):
        self.rng = np.random.default_rng(seed)
        self.max_episode_steps = max_episode_steps

    def _obs(self):
        th, thdot = self.state
        return np.array([np.cos(th), np.sin(th), thdot], dtype=np.float32)

    def reset(self):
        high = np.array([np.pi, 1.0])
        self.state = self.rng.uniform(low=-high, high=high)
        self.t = 0
        return self._obs(), {}

    def step(self, u):
        th, thdot = self.state
        u = np.clip(u, -self.max_torque, self.max_torque)[0]
        angle = ((th + np.pi) % (2 * np.pi)) - np.pi
        costs = angle ** 2 + 0.1 * thdot ** 2 + 0.001 * (u ** 2)
        newthdot = thdot + (3 * self.g / (2 * self.l) * np.sin(th) + 3.0 / (self.m * self.l ** 2) * u) * self.dt
        newthdot = np.clip(newthdot, -self.max_speed, self.max_speed)
        newth = th + newthdot * self.dt
        self.state = np.array([newth, newthdot])
        self.t += 1
        truncated = self.t >= self.max_episode_steps
        if truncated:   # autoreset=True
            self.reset()
        return self._obs(), -costs, False, truncated, {}

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
        for s, a, r, s_prime, done in mini_batch:
            s_lst.append(s)
            a_lst.append([a])
            r_lst.append([r])
            s_prime_lst.append(s_prime)
            done_mask_lst.append([0.0 if done else 1.0])
        return (torch.tensor(s_lst, dtype=torch.float), torch.tensor(a_lst, dtype=torch.float),
                torch.tensor(r_lst, dtype=torch.float), torch.tensor(s_prime_lst, dtype=torch.float),
                torch.tensor(done_mask_lst, dtype=torch.float))

    def size(self):
        return len(self.buffer)


class MuNet(nn.Module):
    def __init__(self):
        super(MuNet, self).__init__()
        self.fc1 = nn.Linear(3, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc_mu = nn.Linear(64, 1)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        return torch.tanh(self.fc_mu(h)) * 2  # Pendulum's actions lie in [-2, 2]


class QNet(nn.Module):
    def __init__(self):
        super(QNet, self).__init__()
        self.fc_s = nn.Linear(3, 64)
        self.fc_a = nn.Linear(1, 64)
        self.fc_q = nn.Linear(128, 32)
        self.fc_out = nn.Linear(32, 1)

    def forward(self, x, a):
        h1 = F.relu(self.fc_s(x))
        h2 = F.relu(self.fc_a(a))
        cat = torch.cat([h1, h2], dim=1)
        h = F.relu(self.fc_q(cat))
        return self.fc_out(h)


class OrnsteinUhlenbeckNoise:
    def __init__(self, mu):
        self.theta, self.dt, self.sigma = 0.1, 0.01, 0.1
        self.mu = mu
        self.x_prev = np.zeros_like(self.mu)

    def __call__(self):
        x = self.x_prev + self.theta * (self.mu - self.x_prev) * self.dt + \
            self.sigma * np.sqrt(self.dt) * np.random.normal(size=self.mu.shape)
        self.x_prev = x
        return x


def train(mu, mu_target, q, q_target, memory, q_optimizer, mu_optimizer):
    s, a, r, s_prime, done_mask = memory.sample(batch_size)

    target = r + gamma * q_target(s_prime, mu_target(s_prime)) * done_mask
    q_loss = F.smooth_l1_loss(q(s, a), target.detach())
    q_optimizer.zero_grad()
    q_loss.backward()
    q_optimizer.step()

    mu_loss = -q(s, mu(s)).mean()  # the whole policy loss
    mu_optimizer.zero_grad()
    mu_loss.backward()
    mu_optimizer.step()


def soft_update(net, net_target):
    for param_target, param in zip(net_target.parameters(), net.parameters()):
        param_target.data.copy_(param_target.data * (1.0 - tau) + param.data * tau)


def main(sg, steps=8, device="cpu", amp=None):
    env = Pendulum(seed=0, max_episode_steps=50)   # 200
    memory = ReplayBuffer()

    q, q_target = QNet(), QNet()
    q_target.load_state_dict(q.state_dict())
    mu, mu_target = MuNet(), MuNet()
    mu_target.load_state_dict(mu.state_dict())

    score = 0.0
    print_interval = 2   # 20

    mu_optimizer = optim.Adam(mu.parameters(), lr=lr_mu)
    q_optimizer = optim.Adam(q.parameters(), lr=lr_q)
    ou_noise = OrnsteinUhlenbeckNoise(mu=np.zeros(1))
    sg.track(mu=mu, mu_target=mu_target, q=q, q_target=q_target,
             mu_optimizer=mu_optimizer, q_optimizer=q_optimizer)

    @sg.compile
    def train_block():
        for i in range(10):
            train(mu, mu_target, q, q_target, memory, q_optimizer, mu_optimizer)
            soft_update(mu, mu_target)
            soft_update(q, q_target)

    trained = 0
    for n_epi in range(10000):
        s, _ = env.reset()
        done = False

        count = 0
        while count < 50 and not done:   # 200
            a = mu(torch.from_numpy(s).float())
            a = a.item() + ou_noise()[0]
            s_prime, r, done, truncated, info = env.step([a])
            memory.put((s, a, r / 100.0, s_prime, done))
            score += r
            s = s_prime
            count += 1

        if memory.size() > 200:   # 2000
            train_block()
            trained += 1

        if n_epi % print_interval == 0 and n_epi != 0:
            sg.log(score / print_interval)   # print("# of episode :{}, avg score : {:.1f}")
            score = 0.0
        if trained == steps:
            break

    env.close()
