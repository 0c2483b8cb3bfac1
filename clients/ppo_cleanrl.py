"""CleanRL's ppo.py (PPO on CartPole-v1, discrete actions): an ``Agent`` with separate actor and
critic MLPs (orthogonal ``layer_init``), Adam(eps=1e-5), linear lr annealing per rollout
(``optimizer.param_groups[0]["lr"] = lrnow``), a rollout collected under ``no_grad`` into
preallocated storage tensors, GAE computed in a reversed Python loop, the batch flattened, then
``update_epochs`` epochs of minibatches over ``np.random.shuffle``d indices. The minibatch update
is the step: ``agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])`` (a
``Categorical`` from logits: ``log_prob``, ``entropy``), the ratio, ``old_approx_kl`` /
``approx_kl`` under ``no_grad``, ``clipfracs += [...float().mean().item()]``, advantage
normalisation, the clipped surrogate, the clipped value loss, the entropy bonus,
``optimizer.zero_grad()``, ``backward()``, ``nn.utils.clip_grad_norm_(agent.parameters(),
max_grad_norm)``, ``optimizer.step()``. The epoch loop's ``target_kl`` check and the end of each
iteration's logging (``v_loss.item()``, ``pg_loss.item()``, ..., ``np.mean(clipfracs)``,
explained variance from ``b_values``/``b_returns`` on numpy) run outside it, as in ppo.py.

Model: vendor/cleanrl/ppo.py (``layer_init``, ``Agent``, verbatim). Loop: ppo.py lines 130-309
(the ``__main__`` block) as written, its body inside ``main``. What a user of stepgraph changes:
the minibatch body becomes ``update_minibatch(mb_inds)``, a closure over the iteration's flattened
batch (``b_obs``, ``b_logprobs``, ... rebound every iteration, as in ppo.py) and ``clipfracs``
(``nonlocal``: ppo.py appends to it with ``+=``); it returns the tensors that the iteration's
logging reads after the loop. Scaled down / replaced: gymnasium's ``SyncVectorEnv`` of
CartPole-v1 is replaced by ``Envs``, 4 copies of the cart-pole dynamics on numpy with their own
seeded generator and auto-reset (as gymnasium's vector env), no ``RecordEpisodeStatistics``
(so no episode printing), no tensorboard/wandb; num_steps 128 -> 8 (batch 32, minibatch 8),
update_epochs 4 -> 1, total_timesteps so that the lr anneals over 4 iterations; ``steps``
counts minibatch updates.
"""
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

from clients.vendor.cleanrl.ppo import Agent

SOURCE = "https://github.com/vwxyzjn/cleanrl/blob/fe8d8a03c41a7ef5b523e2e354bd01c363e786bb/cleanrl/ppo.py"
LICENSE = "MIT"
TAGS = ("rl", "ppo", "categorical", "clip-grad-norm", "adam", "lr-anneal", "item-in-step",
        "numpy-index", "list-extend-in-step", "closure-rebound-tensors")


@dataclass
class Args:  # ppo.py's defaults; the scaled-down ones marked
    exp_name: str = "ppo"
    seed: int = 1
    torch_deterministic: bool = True
    cuda: bool = True
    track: bool = False
    capture_video: bool = False
    env_id: str = "CartPole-v1"
    total_timesteps: int = 128      # 500000 (4 iterations of the scaled-down batch)
    learning_rate: float = 2.5e-4
    num_envs: int = 4
    num_steps: int = 8              # 128
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 1          # 4
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float = None
    batch_size: int = 0
    minibatch_size: int = 0
    num_iterations: int = 0


class Envs:
    """Stands in for ``gym.vector.SyncVectorEnv`` of CartPole-v1: ``num_envs`` cart-poles on numpy,
    one seeded generator, auto-reset on termination/truncation (the returned observation is the
    new episode's first), reward 1.0."""

    class single_observation_space:
        shape = (4,)

    class single_action_space:
        n = 2
        shape = ()

    def __init__(self, num_envs):
        self.num_envs = num_envs

    def reset(self, seed=None):
        self.rng = np.random.default_rng(seed)
        self.state = self.rng.uniform(-0.05, 0.05, size=(self.num_envs, 4))
        self.t = np.zeros(self.num_envs, dtype=np.int64)
        return self.state.astype(np.float32), {}

    def step(self, action):
        gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
        total_mass, polemass_length = masscart + masspole, masspole * length
        x, x_dot, theta, theta_dot = self.state.T
        force = np.where(action == 1, force_mag, -force_mag)
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + polemass_length * theta_dot ** 2 * sintheta) / total_mass
        thetaacc = (gravity * sintheta - costheta * temp) / (
            length * (4.0 / 3.0 - masspole * costheta ** 2 / total_mass))
        xacc = temp - polemass_length * thetaacc * costheta / total_mass
        x, x_dot = x + tau * x_dot, x_dot + tau * xacc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        self.state = np.stack([x, x_dot, theta, theta_dot], axis=1)
        self.t += 1
        terminations = (np.abs(x) > 2.4) | (np.abs(theta) > 12 * 2 * np.pi / 360)
        truncations = self.t >= 500
        done = terminations | truncations
        if done.any():
            self.state[done] = self.rng.uniform(-0.05, 0.05, size=(int(done.sum()), 4))
            self.t[done] = 0
        return self.state.astype(np.float32), np.ones(self.num_envs), terminations, truncations, {}

    def close(self):
        pass


def main(sg, steps=8, device="cpu", amp=None):
    args = Args()
    args.batch_size = int(args.num_envs * args.num_steps)
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = args.total_timesteps // args.batch_size
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device(device)

    # env setup
    envs = Envs(args.num_envs)

    agent = Agent(envs).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    sg.track(agent=agent, optimizer=optimizer)

    # ALGO Logic: Storage setup
    obs = torch.zeros((args.num_steps, args.num_envs) + envs.single_observation_space.shape).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs) + envs.single_action_space.shape).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    # TRY NOT TO MODIFY: start the game
    global_step = 0
    start_time = time.time()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.Tensor(next_obs).to(device)
    next_done = torch.zeros(args.num_envs).to(device)

    b_obs = b_logprobs = b_actions = b_advantages = b_returns = b_values = None
    clipfracs = []

    @sg.compile
    def update_minibatch(mb_inds):
        nonlocal clipfracs
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
        logratio = newlogprob - b_logprobs[mb_inds]
        ratio = logratio.exp()

        with torch.no_grad():
            # calculate approx_kl http://joschu.net/blog/kl-approx.html
            old_approx_kl = (-logratio).mean()
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]

        mb_advantages = b_advantages[mb_inds]
        if args.norm_adv:
            mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

        # Policy loss
        pg_loss1 = -mb_advantages * ratio
        pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()

        # Value loss
        newvalue = newvalue.view(-1)
        if args.clip_vloss:
            v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
            v_clipped = b_values[mb_inds] + torch.clamp(
                newvalue - b_values[mb_inds],
                -args.clip_coef,
                args.clip_coef,
            )
            v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
            v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
            v_loss = 0.5 * v_loss_max.mean()
        else:
            v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

        entropy_loss = entropy.mean()
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl

    updates = 0
    for iteration in range(1, args.num_iterations + 1):
        # Annealing the rate if instructed to do so.
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            lrnow = frac * args.learning_rate
            optimizer.param_groups[0]["lr"] = lrnow

        for step in range(0, args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            dones[step] = next_done

            # ALGO LOGIC: action logic
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob

            # TRY NOT TO MODIFY: execute the game and log data.
            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward).to(device).view(-1)
            next_obs, next_done = torch.Tensor(next_obs).to(device), torch.Tensor(next_done).to(device)

        # bootstrap value if not done
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards).to(device)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        # flatten the batch
        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape((-1,) + envs.single_action_space.shape)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        # Optimizing the policy and value network
        b_inds = np.arange(args.batch_size)
        clipfracs = []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, args.batch_size, args.minibatch_size):
                end = start + args.minibatch_size
                mb_inds = b_inds[start:end]

                v_loss, pg_loss, entropy_loss, old_approx_kl, approx_kl = update_minibatch(mb_inds)
                updates += 1
                if updates == steps:
                    break
            if updates == steps:
                break

            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y

        # TRY NOT TO MODIFY: record rewards for plotting purposes (writer.add_scalar)
        sg.log(dict(learning_rate=optimizer.param_groups[0]["lr"], value_loss=v_loss.item(),
                    policy_loss=pg_loss.item(), entropy=entropy_loss.item(),
                    old_approx_kl=old_approx_kl.item(), approx_kl=approx_kl.item(),
                    clipfrac=float(np.mean(clipfracs)), explained_variance=float(explained_var)))
        if updates == steps:
            break

    envs.close()
