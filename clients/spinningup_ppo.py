"""openai/spinningup's PyTorch PPO (spinup/algos/pytorch/ppo/ppo.py, core.py): PPO-clip with early
stopping on the approximate KL. ``MLPActorCritic`` (core.py): an ``MLPCategoricalActor`` for a
``Discrete`` action space (``Categorical(logits=logits_net(obs))``) or an ``MLPGaussianActor`` for a
``Box`` (``Normal(mu_net(obs), exp(log_std))``, ``log_std`` a parameter at -0.5, log-probs summed
over the last axis), an ``MLPCritic`` (``torch.squeeze(v_net(obs), -1)``), tanh MLPs (64, 64);
``step`` samples under ``no_grad`` and hands numpy back. ``PPOBuffer`` keeps numpy arrays;
``finish_path`` computes GAE-lambda advantages and rewards-to-go with ``discount_cumsum``
(``scipy.signal.lfilter`` on the reversed array); ``get()`` asserts the buffer is full, resets its
pointers, normalises the advantages with ``mpi_statistics_scalar`` (numpy float32 mean/std) --
rebinding ``self.adv_buf`` -- and returns ``torch.as_tensor`` of each array. The step is ppo.py's
``update()`` as written: ``data = buf.get()``; ``compute_loss_pi(data)`` (ratio, clipped surrogate,
``approx_kl``, entropy and clip fraction read with ``.item()`` into ``pi_info``) and
``compute_loss_v(data)`` once for the old losses (``.item()``); ``train_pi_iters`` iterations of
``pi_optimizer.zero_grad()``, ``compute_loss_pi``, ``kl = mpi_avg(pi_info['kl'])``, ``if kl > 1.5 *
target_kl: logger.log('Early stopping ...'); break`` (a branch on a value read on the host),
``backward``, ``mpi_avg_grads``, ``pi_optimizer.step()``; ``logger.store(StopIter=i)``;
``train_v_iters`` value iterations on their own Adam; ``logger.store(LossPi=..., DeltaLossV=...)``
with ``loss_pi.item()`` / ``loss_v.item()``. Two Adams (pi_lr 3e-4, vf_lr 1e-3).

What a user of stepgraph changes: ``update`` is decorated (``@stepgraph.compile`` above ``def
update()``, a closure over ``buf``, ``ac``, the optimizers and the logger, as ppo.py defines it).
Everything else is ppo.py's ``ppo()`` as written. Replaced: gym's CartPole-v1 by ``CartPole`` (the
cart-pole dynamics on numpy, a seeded generator, the old gym API ``reset() -> obs``, ``step() ->
(obs, r, d, info)``, which ppo.py uses; ``Discrete(2)``/``Box(4)`` spaces restated); MPI with one
process, restated: ``mpi_avg`` of a Python float is ``np.float32`` (mpi_tools' Allreduce buffer),
``mpi_avg_grads``/``sync_params`` do nothing, ``mpi_statistics_scalar`` is its float32 sum / n and
sqrt of the summed squares / n; ``EpochLogger`` restated as its ``store`` (a dict of lists),
``log`` (print, here a list) and ``log_tabular``/``dump_tabular`` (averages of the stored values,
logged with ``sg.log``, then cleared); no model saving. Scaled down: steps_per_epoch 4000 -> 64,
train_pi_iters 80 -> 6, train_v_iters 80 -> 4, epochs = ``steps`` (one ``update()`` per epoch).
Sizes, learning rates, ``clip_ratio``, ``target_kl``, gamma and lam are ppo.py's.
``ACTION_SPACE = "box"`` runs the Gaussian policy on ``ContinuousCartPole`` (force = clipped
action * 10).

Source: https://github.com/openai/spinningup/blob/038665d62d569055401d91856abb287263096178/spinup/algos/pytorch/ppo/ppo.py
(and core.py, utils/mpi_tools.py, utils/mpi_pytorch.py, utils/logx.py at that commit), MIT License,
Copyright (c) 2018 OpenAI. Restated after the source, not copied: same modules, names, ops,
initialisation and semantics.
"""
import time

import numpy as np
import scipy.signal
import torch
import torch.nn as nn
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal
from torch.optim import Adam

SOURCE = ("https://github.com/openai/spinningup/blob/038665d62d569055401d91856abb287263096178/"
          "spinup/algos/pytorch/ppo/ppo.py")
LICENSE = "MIT"
DEVICES = ("cpu",)  # spinningup's PyTorch algorithms run on the CPU (ac.step returns .numpy())
TAGS = ("rl", "ppo", "categorical", "numpy-buffer", "numpy-in-step", "as-tensor-in-step", "item-in-step",
        "early-stop-on-host-read", "break-in-step", "two-optimizers", "inner-loop-in-step",
        "logger-store-in-step", "scipy")

ACTION_SPACE = "discrete"   # "box": the Gaussian policy


# --- gym.spaces, restated ---------------------------------------------------------------------
class Box:
    def __init__(self, low, high, shape):
        self.low, self.high, self.shape = low, high, shape


class Discrete:
    def __init__(self, n):
        self.n, self.shape = n, ()


class CartPole:
    """Stands in for gym's CartPole-v1 (old API, as ppo.py calls it)."""
    observation_space = Box(-np.inf, np.inf, (4,))
    action_space = Discrete(2)

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def reset(self):
        self.state = self.rng.uniform(-0.05, 0.05, size=4)
        return self.state.astype(np.float32)

    def force(self, action):
        return 10.0 if action == 1 else -10.0

    def step(self, action):
        gravity, masscart, masspole, length, tau = 9.8, 1.0, 0.1, 0.5, 0.02
        total_mass, polemass_length = masscart + masspole, masspole * length
        x, x_dot, theta, theta_dot = self.state
        force = self.force(action)
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + polemass_length * theta_dot ** 2 * sintheta) / total_mass
        thetaacc = (gravity * sintheta - costheta * temp) / (
            length * (4.0 / 3.0 - masspole * costheta ** 2 / total_mass))
        xacc = temp - polemass_length * thetaacc * costheta / total_mass
        x, x_dot = x + tau * x_dot, x_dot + tau * xacc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        self.state = np.array([x, x_dot, theta, theta_dot])
        done = bool(abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360)
        return self.state.astype(np.float32), 1.0, done, {}


class ContinuousCartPole(CartPole):
    action_space = Box(-1.0, 1.0, (1,))

    def force(self, action):
        return 10.0 * float(np.clip(action, -1.0, 1.0)[0])


# --- spinup/utils/mpi_tools.py, mpi_pytorch.py with one process --------------------------------
def num_procs():
    return 1


def proc_id():
    return 0


def mpi_op(x):
    x, scalar = ([x], True) if np.isscalar(x) else (x, False)
    x = np.asarray(x, dtype=np.float32)
    buff = x.copy()   # MPI.COMM_WORLD.Allreduce(x, buff, op=MPI.SUM) with one process
    return buff[0] if scalar else buff


def mpi_sum(x):
    return mpi_op(x)


def mpi_avg(x):
    return mpi_sum(x) / num_procs()


def mpi_statistics_scalar(x):
    x = np.array(x, dtype=np.float32)
    global_sum, global_n = mpi_sum([np.sum(x), len(x)])
    mean = global_sum / global_n
    global_sum_sq = mpi_sum(np.sum((x - mean)**2))
    std = np.sqrt(global_sum_sq / global_n)
    return mean, std


def mpi_avg_grads(module):
    if num_procs() == 1:
        return


def sync_params(module):
    if num_procs() == 1:
        return


# --- spinup/utils/logx.py EpochLogger, the parts ppo() uses ---------------------------------------
class EpochLogger:
    def __init__(self):
        self.epoch_dict = dict()
        self.lines = []
        self.log_current_row = {}

    def log(self, msg):
        self.lines.append(msg)   # print(colorize(msg, 'green', bold=True))

    def store(self, **kwargs):
        for k, v in kwargs.items():
            if not (k in self.epoch_dict.keys()):
                self.epoch_dict[k] = []
            self.epoch_dict[k].append(v)

    def log_tabular(self, key, val=None, with_min_and_max=False, average_only=False):
        if val is not None:
            self.log_current_row[key] = val
        else:
            v = self.epoch_dict[key] if key in self.epoch_dict else []
            vals = np.concatenate(v) if len(v) > 0 and isinstance(v[0], np.ndarray) and len(v[0].shape) > 0 else v
            mean, std = mpi_statistics_scalar(vals) if len(vals) else (np.nan, np.nan)
            self.log_current_row['Average' + key] = float(mean)
            if not average_only:
                self.log_current_row['Std' + key] = float(std)
            if with_min_and_max and len(vals):
                self.log_current_row['Max' + key] = float(np.max(vals))
                self.log_current_row['Min' + key] = float(np.min(vals))
        self.epoch_dict[key] = []

    def dump_tabular(self):
        row, self.log_current_row = self.log_current_row, {}
        return row


# --- core.py ----------------------------------------------------------------------------------
def combined_shape(length, shape=None):
    if shape is None:
        return (length,)
    return (length, shape) if np.isscalar(shape) else (length, *shape)


def mlp(sizes, activation, output_activation=nn.Identity):
    layers = []
    for j in range(len(sizes)-1):
        act = activation if j < len(sizes)-2 else output_activation
        layers += [nn.Linear(sizes[j], sizes[j+1]), act()]
    return nn.Sequential(*layers)


def count_vars(module):
    return sum([np.prod(p.shape) for p in module.parameters()])


def discount_cumsum(x, discount):
    """[x0 + d x1 + d^2 x2, x1 + d x2, x2] (rllab's lfilter trick)."""
    return scipy.signal.lfilter([1], [1, float(-discount)], x[::-1], axis=0)[::-1]


class Actor(nn.Module):

    def _distribution(self, obs):
        raise NotImplementedError

    def _log_prob_from_distribution(self, pi, act):
        raise NotImplementedError

    def forward(self, obs, act=None):
        pi = self._distribution(obs)
        logp_a = None
        if act is not None:
            logp_a = self._log_prob_from_distribution(pi, act)
        return pi, logp_a


class MLPCategoricalActor(Actor):

    def __init__(self, obs_dim, act_dim, hidden_sizes, activation):
        super().__init__()
        self.logits_net = mlp([obs_dim] + list(hidden_sizes) + [act_dim], activation)

    def _distribution(self, obs):
        logits = self.logits_net(obs)
        return Categorical(logits=logits)

    def _log_prob_from_distribution(self, pi, act):
        return pi.log_prob(act)


class MLPGaussianActor(Actor):

    def __init__(self, obs_dim, act_dim, hidden_sizes, activation):
        super().__init__()
        log_std = -0.5 * np.ones(act_dim, dtype=np.float32)
        self.log_std = torch.nn.Parameter(torch.as_tensor(log_std))
        self.mu_net = mlp([obs_dim] + list(hidden_sizes) + [act_dim], activation)

    def _distribution(self, obs):
        mu = self.mu_net(obs)
        std = torch.exp(self.log_std)
        return Normal(mu, std)

    def _log_prob_from_distribution(self, pi, act):
        return pi.log_prob(act).sum(axis=-1)


class MLPCritic(nn.Module):

    def __init__(self, obs_dim, hidden_sizes, activation):
        super().__init__()
        self.v_net = mlp([obs_dim] + list(hidden_sizes) + [1], activation)

    def forward(self, obs):
        return torch.squeeze(self.v_net(obs), -1)


class MLPActorCritic(nn.Module):

    def __init__(self, observation_space, action_space, hidden_sizes=(64, 64), activation=nn.Tanh):
        super().__init__()
        obs_dim = observation_space.shape[0]
        if isinstance(action_space, Box):
            self.pi = MLPGaussianActor(obs_dim, action_space.shape[0], hidden_sizes, activation)
        elif isinstance(action_space, Discrete):
            self.pi = MLPCategoricalActor(obs_dim, action_space.n, hidden_sizes, activation)
        self.v = MLPCritic(obs_dim, hidden_sizes, activation)

    def step(self, obs):
        with torch.no_grad():
            pi = self.pi._distribution(obs)
            a = pi.sample()
            logp_a = self.pi._log_prob_from_distribution(pi, a)
            v = self.v(obs)
        return a.numpy(), v.numpy(), logp_a.numpy()

    def act(self, obs):
        return self.step(obs)[0]


# --- ppo.py -----------------------------------------------------------------------------------
class PPOBuffer:
    """Trajectories of one epoch, with GAE-lambda advantages (numpy arrays)."""

    def __init__(self, obs_dim, act_dim, size, gamma=0.99, lam=0.95):
        self.obs_buf = np.zeros(combined_shape(size, obs_dim), dtype=np.float32)
        self.act_buf = np.zeros(combined_shape(size, act_dim), dtype=np.float32)
        self.adv_buf = np.zeros(size, dtype=np.float32)
        self.rew_buf = np.zeros(size, dtype=np.float32)
        self.ret_buf = np.zeros(size, dtype=np.float32)
        self.val_buf = np.zeros(size, dtype=np.float32)
        self.logp_buf = np.zeros(size, dtype=np.float32)
        self.gamma, self.lam = gamma, lam
        self.ptr, self.path_start_idx, self.max_size = 0, 0, size

    def store(self, obs, act, rew, val, logp):
        assert self.ptr < self.max_size
        self.obs_buf[self.ptr] = obs
        self.act_buf[self.ptr] = act
        self.rew_buf[self.ptr] = rew
        self.val_buf[self.ptr] = val
        self.logp_buf[self.ptr] = logp
        self.ptr += 1

    def finish_path(self, last_val=0):
        path_slice = slice(self.path_start_idx, self.ptr)
        rews = np.append(self.rew_buf[path_slice], last_val)
        vals = np.append(self.val_buf[path_slice], last_val)

        # GAE-lambda advantages
        deltas = rews[:-1] + self.gamma * vals[1:] - vals[:-1]
        self.adv_buf[path_slice] = discount_cumsum(deltas, self.gamma * self.lam)

        # rewards-to-go, the value targets
        self.ret_buf[path_slice] = discount_cumsum(rews, self.gamma)[:-1]

        self.path_start_idx = self.ptr

    def get(self):
        assert self.ptr == self.max_size
        self.ptr, self.path_start_idx = 0, 0
        # advantage normalization
        adv_mean, adv_std = mpi_statistics_scalar(self.adv_buf)
        self.adv_buf = (self.adv_buf - adv_mean) / adv_std
        data = dict(obs=self.obs_buf, act=self.act_buf, ret=self.ret_buf,
                    adv=self.adv_buf, logp=self.logp_buf)
        return {k: torch.as_tensor(v, dtype=torch.float32) for k, v in data.items()}


def ppo(sg, env_fn, actor_critic=MLPActorCritic, ac_kwargs=dict(), seed=0,
        steps_per_epoch=64, epochs=8, gamma=0.99, clip_ratio=0.2, pi_lr=3e-4,
        vf_lr=1e-3, train_pi_iters=6, train_v_iters=4, lam=0.97, max_ep_len=1000,
        target_kl=0.01, save_freq=10):
    logger = EpochLogger()

    seed += 10000 * proc_id()
    torch.manual_seed(seed)
    np.random.seed(seed)

    env = env_fn()
    obs_dim = env.observation_space.shape
    act_dim = env.action_space.shape

    ac = actor_critic(env.observation_space, env.action_space, **ac_kwargs)
    sync_params(ac)

    var_counts = tuple(count_vars(module) for module in [ac.pi, ac.v])
    logger.log('\nNumber of parameters: \t pi: %d, \t v: %d\n' % var_counts)

    local_steps_per_epoch = int(steps_per_epoch / num_procs())
    buf = PPOBuffer(obs_dim, act_dim, local_steps_per_epoch, gamma, lam)

    def compute_loss_pi(data):
        obs, act, adv, logp_old = data['obs'], data['act'], data['adv'], data['logp']

        # Policy loss
        pi, logp = ac.pi(obs, act)
        ratio = torch.exp(logp - logp_old)
        clip_adv = torch.clamp(ratio, 1-clip_ratio, 1+clip_ratio) * adv
        loss_pi = -(torch.min(ratio * adv, clip_adv)).mean()

        # Useful extra info
        approx_kl = (logp_old - logp).mean().item()
        ent = pi.entropy().mean().item()
        clipped = ratio.gt(1+clip_ratio) | ratio.lt(1-clip_ratio)
        clipfrac = torch.as_tensor(clipped, dtype=torch.float32).mean().item()
        pi_info = dict(kl=approx_kl, ent=ent, cf=clipfrac)

        return loss_pi, pi_info

    def compute_loss_v(data):
        obs, ret = data['obs'], data['ret']
        return ((ac.v(obs) - ret)**2).mean()

    pi_optimizer = Adam(ac.pi.parameters(), lr=pi_lr)
    vf_optimizer = Adam(ac.v.parameters(), lr=vf_lr)
    sg.track(ac=ac, pi_optimizer=pi_optimizer, vf_optimizer=vf_optimizer)

    @sg.compile   # = @stepgraph.compile
    def update():
        data = buf.get()

        pi_l_old, pi_info_old = compute_loss_pi(data)
        pi_l_old = pi_l_old.item()
        v_l_old = compute_loss_v(data).item()

        # Train policy with multiple steps of gradient descent
        for i in range(train_pi_iters):
            pi_optimizer.zero_grad()
            loss_pi, pi_info = compute_loss_pi(data)
            kl = mpi_avg(pi_info['kl'])
            if kl > 1.5 * target_kl:
                logger.log('Early stopping at step %d due to reaching max kl.' % i)
                break
            loss_pi.backward()
            mpi_avg_grads(ac.pi)
            pi_optimizer.step()

        logger.store(StopIter=i)

        # Value function learning
        for i in range(train_v_iters):
            vf_optimizer.zero_grad()
            loss_v = compute_loss_v(data)
            loss_v.backward()
            mpi_avg_grads(ac.v)
            vf_optimizer.step()

        # Log changes from update
        kl, ent, cf = pi_info['kl'], pi_info_old['ent'], pi_info['cf']
        logger.store(LossPi=pi_l_old, LossV=v_l_old,
                     KL=kl, Entropy=ent, ClipFrac=cf,
                     DeltaLossPi=(loss_pi.item() - pi_l_old),
                     DeltaLossV=(loss_v.item() - v_l_old))

    start_time = time.time()
    o, ep_ret, ep_len = env.reset(), 0, 0

    for epoch in range(epochs):
        for t in range(local_steps_per_epoch):
            a, v, logp = ac.step(torch.as_tensor(o, dtype=torch.float32))

            next_o, r, d, _ = env.step(a)
            ep_ret += r
            ep_len += 1

            buf.store(o, a, r, v, logp)
            logger.store(VVals=v)

            o = next_o

            timeout = ep_len == max_ep_len
            terminal = d or timeout
            epoch_ended = t == local_steps_per_epoch-1

            if terminal or epoch_ended:
                if epoch_ended and not (terminal):
                    logger.log('Warning: trajectory cut off by epoch at %d steps.' % ep_len)
                if timeout or epoch_ended:
                    _, v, _ = ac.step(torch.as_tensor(o, dtype=torch.float32))
                else:
                    v = 0
                buf.finish_path(v)
                if terminal:
                    logger.store(EpRet=ep_ret, EpLen=ep_len)
                o, ep_ret, ep_len = env.reset(), 0, 0

        # (model saving every save_freq epochs: dropped)

        # Perform PPO update!
        update()

        logger.log_tabular('Epoch', epoch)
        logger.log_tabular('EpRet', with_min_and_max=True)
        logger.log_tabular('EpLen', average_only=True)
        logger.log_tabular('VVals', with_min_and_max=True)
        logger.log_tabular('TotalEnvInteracts', (epoch+1)*steps_per_epoch)
        logger.log_tabular('LossPi', average_only=True)
        logger.log_tabular('LossV', average_only=True)
        logger.log_tabular('DeltaLossPi', average_only=True)
        logger.log_tabular('DeltaLossV', average_only=True)
        logger.log_tabular('Entropy', average_only=True)
        logger.log_tabular('KL', average_only=True)
        logger.log_tabular('ClipFrac', average_only=True)
        logger.log_tabular('StopIter', average_only=True)
        # logger.log_tabular('Time', time.time()-start_time): wall time, not compared
        sg.log(logger.dump_tabular())
    sg.log(logger.lines)


def main(sg, steps=8, device="cpu", amp=None):
    env_fn = (lambda: CartPole(seed=0)) if ACTION_SPACE == "discrete" else (lambda: ContinuousCartPole(seed=0))
    ppo(sg, env_fn, actor_critic=MLPActorCritic, ac_kwargs=dict(hidden_sizes=[64] * 2), gamma=0.99,
        seed=0, steps_per_epoch=64, epochs=steps)
