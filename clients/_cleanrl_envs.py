"""Synthetic stand-ins for the gymnasium vector environments CleanRL's off-policy scripts make
(``gym.vector.SyncVectorEnv([make_env(...)])``, gymnasium 0.29 semantics, which CleanRL pins):
auto-reset inside ``step`` (the returned observation of a finished sub-env is its new episode's
first; the last one is in ``infos["final_observation"]``), ``infos["final_info"]`` carrying
``RecordEpisodeStatistics``'s ``{"episode": {"r", "l"}}``, ``single_observation_space`` /
``single_action_space`` as the scripts read them. Not vendored code: the corpus's synthetic env.

``MujocoLike``: a continuous-control task shaped as Hopper-v4 (11-dim float64 observations,
3 actions in [-1, 1]), random smooth dynamics, truncation at ``max_episode_steps``.
``CartPoles``: CartPole-v1's dynamics (float32 observations, 2 actions)."""
import numpy as np

from clients.vendor.cleanrl import spaces


class _VectorEnv:
    max_episode_steps = 500

    def __init__(self, num_envs, seed=0):
        self.num_envs = num_envs
        self.rng = np.random.default_rng(seed)

    def reset(self, seed=None):
        self.rng = np.random.default_rng(seed)
        self.state = np.stack([self._reset_one() for _ in range(self.num_envs)])
        self.t = np.zeros(self.num_envs, dtype=np.int64)
        self.ret = np.zeros(self.num_envs)
        return self.state.astype(self.obs_dtype), {}

    def step(self, actions):
        next_state, rewards, terminations = self._dynamics(self.state, np.asarray(actions))
        self.t += 1
        self.ret += rewards
        truncations = (self.t >= self.max_episode_steps) & ~terminations
        infos = {}
        done = terminations | truncations
        if done.any():
            infos["final_observation"] = np.array([None] * self.num_envs, dtype=object)
            infos["final_info"] = np.array([None] * self.num_envs, dtype=object)
            infos["_final_observation"] = done.copy()
            for i in np.flatnonzero(done):
                infos["final_observation"][i] = next_state[i].astype(self.obs_dtype)
                infos["final_info"][i] = {"episode": {"r": np.array([self.ret[i]]), "l": np.array([self.t[i]])}}
                next_state[i] = self._reset_one()
                self.t[i], self.ret[i] = 0, 0.0
        self.state = next_state
        return self.state.astype(self.obs_dtype), rewards, terminations, truncations, infos

    def close(self):
        pass


class MujocoLike(_VectorEnv):
    obs_dtype = np.float64
    max_episode_steps = 40

    def __init__(self, num_envs, seed=0, obs_dim=11, act_dim=3):
        super().__init__(num_envs, seed)
        self.single_observation_space = spaces.Box(-np.inf, np.inf, (obs_dim,), np.float64)
        self.single_action_space = spaces.Box(-1.0, 1.0, (act_dim,), np.float32, seed=seed)
        g = np.random.default_rng(1234)
        self.A = g.normal(0, 0.3, (obs_dim, obs_dim))
        self.B = g.normal(0, 0.5, (act_dim, obs_dim))
        self.w = g.normal(0, 1.0, obs_dim)

    def _reset_one(self):
        return self.rng.uniform(-0.005, 0.005, size=self.single_observation_space.shape)

    def _dynamics(self, s, a):
        s = np.tanh(s @ self.A + a @ self.B) + self.rng.normal(0, 0.01, s.shape)
        reward = s @ self.w - 1e-3 * (a ** 2).sum(-1)
        return s, reward, np.abs(s[:, 0]) > 0.9


class CartPoles(_VectorEnv):
    obs_dtype = np.float32

    def __init__(self, num_envs, seed=0):
        super().__init__(num_envs, seed)
        self.single_observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.single_action_space = spaces.Discrete(2, seed=seed)

    def _reset_one(self):
        return self.rng.uniform(-0.05, 0.05, size=4)

    def _dynamics(self, s, action):
        gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
        total_mass, polemass_length = masscart + masspole, masspole * length
        x, x_dot, theta, theta_dot = s.T
        force = np.where(action == 1, force_mag, -force_mag)
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + polemass_length * theta_dot ** 2 * sintheta) / total_mass
        thetaacc = (gravity * sintheta - costheta * temp) / (
            length * (4.0 / 3.0 - masspole * costheta ** 2 / total_mass))
        xacc = temp - polemass_length * thetaacc * costheta / total_mass
        x, x_dot = x + tau * x_dot, x_dot + tau * xacc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        terminations = (np.abs(x) > 2.4) | (np.abs(theta) > 12 * 2 * np.pi / 360)
        return np.stack([x, x_dot, theta, theta_dot], axis=1), np.ones(self.num_envs), terminations


class SummaryWriter:
    """Stands in for ``torch.utils.tensorboard.SummaryWriter`` (tensorboard is not installed):
    keeps the scalars it is given. Unlike tensorboard's, this class is the client's own code, so
    stepgraph traces its ``add_scalar`` as the step's code (and warns that replays will not
    append); tensorboard's lives in ``torch.utils`` and would be traced as library code (its
    ``make_np`` reads a tensor argument on the host). In the corpus runs the logging branch
    (``global_step % 100 == 0``) is a graph captured at its one call, never replayed."""

    def __init__(self, log_dir=None):
        self.scalars = []

    def add_text(self, tag, text):
        pass

    def add_scalar(self, tag, value, global_step=None):
        self.scalars.append((tag, value, global_step))

    def close(self):
        pass
