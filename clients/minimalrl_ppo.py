"""seungeunrho/minimalRL's ppo.py: PPO on CartPole-v1 in one file. A ``PPO`` module (a shared
``fc1`` 4->256, a policy head ``fc_pi`` and a value head ``fc_v``) that owns its Adam optimizer
(``self.optimizer``) and its rollout (``self.data``, a plain list of transitions appended by
``put_data``). The environment loop samples actions from ``Categorical(model.pi(s))`` and stores
``(s, a, r/100.0, s_prime, prob[a].item(), done)``; every ``T_horizon`` steps (or at the end of
the episode) it calls ``model.train_net()``, the step: ``make_batch()`` builds the batch with
``torch.tensor`` of Python lists (numpy observations, ints, floats) and resets ``self.data = []``;
then ``K_epoch`` epochs of: the TD target ``r + gamma * v(s') * done_mask``, ``delta`` brought to
numpy (``delta.detach().numpy()``), GAE in a Python loop over the reversed deltas
(``advantage_lst.reverse()``, ``torch.tensor(advantage_lst, dtype=torch.float)``), the ratio
``exp(log(pi_a) - log(prob_a))``, the clipped surrogate plus ``F.smooth_l1_loss(v(s),
td_target.detach())``, ``zero_grad`` / ``loss.mean().backward()`` / ``step``. It takes no
arguments and returns nothing: everything flows through the module's attributes.

What a user of stepgraph changes: ``train_net`` is decorated (``PPO.train_net =
sg.compile(PPO.train_net)`` at the start of ``main``, the same as ``@stepgraph.compile`` above
the method: the module is the step's ``self`` argument). Everything else is ppo.py's ``main()``
as written. Scaled down / replaced: gym's CartPole-v1 is replaced by ``CartPole``, the cart-pole
dynamics on numpy with its own seeded generator (reward 1.0, termination as CartPole's, the
5-tuple of gym >= 0.26, which ppo.py unpacks); ``print_interval`` 20 -> 2 (the print is kept
as ``sg.log`` of the average score); ``steps`` counts ``train_net`` calls. Hyper-parameters and
sizes are ppo.py's.

Source: https://github.com/seungeunrho/minimalRL/blob/c8efed8481e3cd40e9739cfde220a55522555b57/ppo.py
(MIT License, Copyright (c) 2019 seungeunrho). Restated after the source, not copied: same
modules, names, ops, initialisation and semantics.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributions import Categorical

SOURCE = "https://github.com/seungeunrho/minimalRL/blob/c8efed8481e3cd40e9739cfde220a55522555b57/ppo.py"
LICENSE = "MIT"
DEVICES = ("cpu",)  # ppo.py is CPU-only (torch.from_numpy states, delta.numpy())
TAGS = ("rl", "ppo", "gae-in-python", "numpy-in-step", "tensor-from-list", "module-owns-optimizer",
        "module-list-attribute", "no-args-step", "method-step", "categorical")

# Hyperparameters (ppo.py's)
learning_rate = 0.0005
gamma = 0.98
lmbda = 0.95
eps_clip = 0.1
K_epoch = 3
T_horizon = 20


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


class PPO(nn.Module):
    def __init__(self):
        super(PPO, self).__init__()
        self.data = []

        self.fc1 = nn.Linear(4, 256)
        self.fc_pi = nn.Linear(256, 2)
        self.fc_v = nn.Linear(256, 1)
        self.optimizer = optim.Adam(self.parameters(), lr=learning_rate)

    def pi(self, x, softmax_dim=0):
        h = F.relu(self.fc1(x))
        logits = self.fc_pi(h)
        return F.softmax(logits, dim=softmax_dim)

    def v(self, x):
        h = F.relu(self.fc1(x))
        return self.fc_v(h)

    def put_data(self, transition):
        self.data.append(transition)

    def make_batch(self):
        s_lst, a_lst, r_lst, s_prime_lst, prob_a_lst, done_lst = [], [], [], [], [], []
        for s, a, r, s_prime, prob_a, done in self.data:
            s_lst.append(s)
            a_lst.append([a])
            r_lst.append([r])
            s_prime_lst.append(s_prime)
            prob_a_lst.append([prob_a])
            done_lst.append([0 if done else 1])

        s = torch.tensor(s_lst, dtype=torch.float)
        a = torch.tensor(a_lst)
        r = torch.tensor(r_lst)
        s_prime = torch.tensor(s_prime_lst, dtype=torch.float)
        done_mask = torch.tensor(done_lst, dtype=torch.float)
        prob_a = torch.tensor(prob_a_lst)
        self.data = []
        return s, a, r, s_prime, done_mask, prob_a

    def train_net(self):
        s, a, r, s_prime, done_mask, prob_a = self.make_batch()

        for i in range(K_epoch):
            td_target = r + gamma * self.v(s_prime) * done_mask
            delta = td_target - self.v(s)
            delta = delta.detach().numpy()

            # GAE, backwards over the rollout in Python floats
            advantage_lst = []
            advantage = 0.0
            for delta_t in delta[::-1]:
                advantage = gamma * lmbda * advantage + delta_t[0]
                advantage_lst.append([advantage])
            advantage_lst.reverse()
            advantage = torch.tensor(advantage_lst, dtype=torch.float)

            pi = self.pi(s, softmax_dim=1)
            pi_a = pi.gather(1, a)
            ratio = torch.exp(torch.log(pi_a) - torch.log(prob_a))  # a/b == exp(log(a)-log(b))

            surr1 = ratio * advantage
            surr2 = torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip) * advantage
            loss = -torch.min(surr1, surr2) + F.smooth_l1_loss(self.v(s), td_target.detach())

            self.optimizer.zero_grad()
            loss.mean().backward()
            self.optimizer.step()


def main(sg, steps=8, device="cpu", amp=None):
    PPO.train_net = sg.compile(PPO.train_net)   # = @stepgraph.compile above ``def train_net``

    env = CartPole(seed=0)
    model = PPO()
    sg.track(model=model, optimizer=model.optimizer)
    score = 0.0
    print_interval = 2   # 20
    trained = 0

    for n_epi in range(10000):
        s, _ = env.reset()
        done = False
        while not done:
            for t in range(T_horizon):
                prob = model.pi(torch.from_numpy(s).float())
                m = Categorical(prob)
                a = m.sample().item()
                s_prime, r, done, truncated, info = env.step(a)

                model.put_data((s, a, r / 100.0, s_prime, prob[a].item(), done))
                s = s_prime

                score += r
                if done:
                    break

            model.train_net()
            trained += 1
            if trained == steps:
                sg.log(score)
                env.close()
                return

        if n_epi % print_interval == 0 and n_epi != 0:
            sg.log(score / print_interval)   # print("# of episode :{}, avg score : {:.1f}")
            score = 0.0

    env.close()
