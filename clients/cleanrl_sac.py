"""CleanRL's sac_continuous_action.py (SAC on Hopper-v4, continuous actions): an ``Actor``
(tanh-squashed ``Normal`` with ``rsample``, log-std squashed into [LOG_STD_MIN, LOG_STD_MAX],
``action_scale``/``action_bias`` buffers), twin ``SoftQNetwork`` critics and their targets, Adam
for the critics (one optimizer over both), Adam for the actor, and the entropy temperature
autotuned: ``log_alpha`` a plain leaf tensor with its own Adam, and ``alpha =
log_alpha.exp().item()`` a Python float read back from the device after each temperature step
and used by the next critic and actor losses. Off-policy data from the replay buffer
(``rb.sample`` draws indices with ``np.random.randint`` and converts each numpy field with
``torch.tensor(array, device=...)``, SB3's ``to_torch``).

The step is the body of ``if global_step > args.learning_starts:`` as written: the critic
target under ``no_grad`` (``alpha * next_state_log_pi``), both critic losses, ``q_optimizer``;
then ``if global_step % args.policy_frequency == 0:`` its ``for _ in range(policy_frequency)``
loop of actor steps, each followed by the temperature step and ``alpha = ...item()``; then the
soft target updates (``target_param.data.copy_(tau * param.data + (1 - tau) *
target_param.data)``) under ``if global_step % args.target_network_frequency == 0:``; then the
``if global_step % 100 == 0:`` logging (``writer.add_scalar(..., x.item(), global_step)``,
``print("SPS: ...")``). ``global_step`` is read as the program reads it (here main's loop
variable, a closure cell; the script's module global), ``alpha`` is rebound by the step
(``nonlocal alpha``: the script's ``global``). What a user of stepgraph changes: the body is
indented into ``update(data)`` and ``data = rb.sample(args.batch_size)`` stays at the call site
(it is the step's batch, drawn with numpy's global generator, as a data loader's).

Model: vendor/cleanrl/sac_continuous_action.py (``SoftQNetwork``, ``Actor``, restated: same
layers, names and ops, not a copy); replay buffer: vendor/cleanrl/buffers.py (what the scripts
use of CleanRL's copy of SB3's ``ReplayBuffer``, restated likewise, on a gymnasium stand-in). Loop: the script's ``__main__`` block as written, inside ``main``.
Scaled down / replaced: gymnasium's Hopper-v4 by ``_cleanrl_envs.MujocoLike`` (same spaces,
synthetic dynamics, episodes of 40 steps so ``final_observation`` is used), tensorboard's
``SummaryWriter`` by a stub that keeps the scalars (the ``losses/`` ones are compared), no
wandb/tyro; buffer_size 1e6 -> 10000, learning_starts 5e3 -> 95 (so the 8 updates, global steps
96..103, take both policy_frequency paths and the ``% 100`` logging once); ``steps`` counts
updates.
"""
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

from clients._cleanrl_envs import MujocoLike, SummaryWriter
from clients.vendor.cleanrl.buffers import ReplayBuffer
from clients.vendor.cleanrl.sac_continuous_action import Actor, SoftQNetwork

SOURCE = "https://github.com/vwxyzjn/cleanrl/blob/fe8d8a03c41a7ef5b523e2e354bd01c363e786bb/cleanrl/sac_continuous_action.py"
LICENSE = "MIT"
TAGS = ("rl", "sac", "off-policy", "replay-buffer", "target-network", "soft-update-data-copy",
        "item-in-step", "nonlocal-float-rebound", "policy-delay-branch", "three-optimizers",
        "rsample", "writer-in-step")


@dataclass
class Args:  # sac_continuous_action.py's defaults; the scaled-down ones marked
    exp_name: str = "sac_continuous_action"
    seed: int = 1
    torch_deterministic: bool = True
    cuda: bool = True
    track: bool = False
    capture_video: bool = False
    env_id: str = "Hopper-v4"
    total_timesteps: int = 1000000
    num_envs: int = 1
    buffer_size: int = 10000        # int(1e6)
    gamma: float = 0.99
    tau: float = 0.005
    batch_size: int = 256
    learning_starts: int = 95       # 5e3
    policy_lr: float = 3e-4
    q_lr: float = 1e-3
    policy_frequency: int = 2
    target_network_frequency: int = 1  # Denis Yarats' implementation delays this by 2.
    alpha: float = 0.2
    autotune: bool = True


def main(sg, steps=8, device="cpu", amp=None):
    args = Args()
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}")

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device(device)

    # env setup
    envs = MujocoLike(args.num_envs, seed=args.seed)

    max_action = float(envs.single_action_space.high[0])

    actor = Actor(envs).to(device)
    qf1 = SoftQNetwork(envs).to(device)
    qf2 = SoftQNetwork(envs).to(device)
    qf1_target = SoftQNetwork(envs).to(device)
    qf2_target = SoftQNetwork(envs).to(device)
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.policy_lr)

    # Automatic entropy tuning
    if args.autotune:
        target_entropy = -torch.prod(torch.Tensor(envs.single_action_space.shape).to(device)).item()
        log_alpha = torch.zeros(1, requires_grad=True, device=device)
        alpha = log_alpha.exp().item()
        a_optimizer = optim.Adam([log_alpha], lr=args.q_lr)
    else:
        alpha = args.alpha
    sg.track(actor=actor, qf1=qf1, qf2=qf2, qf1_target=qf1_target, qf2_target=qf2_target,
             q_optimizer=q_optimizer, actor_optimizer=actor_optimizer, a_optimizer=a_optimizer,
             log_alpha=log_alpha)

    envs.single_observation_space.dtype = np.float32
    rb = ReplayBuffer(
        args.buffer_size,
        envs.single_observation_space,
        envs.single_action_space,
        device,
        n_envs=args.num_envs,
        handle_timeout_termination=False,
    )
    start_time = time.time()

    @sg.compile
    def update(data):
        nonlocal alpha
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = actor.get_action(data.next_observations)
            qf1_next_target = qf1_target(data.next_observations, next_state_actions)
            qf2_next_target = qf2_target(data.next_observations, next_state_actions)
            min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
            next_q_value = data.rewards.flatten() + (1 - data.dones.flatten()) * args.gamma * (min_qf_next_target).view(-1)

        qf1_a_values = qf1(data.observations, data.actions).view(-1)
        qf2_a_values = qf2(data.observations, data.actions).view(-1)
        qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
        qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
        qf_loss = qf1_loss + qf2_loss

        # optimize the model
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()

        if global_step % args.policy_frequency == 0:  # TD 3 Delayed update support
            for _ in range(
                args.policy_frequency
            ):  # compensate for the delay by doing 'actor_update_interval' instead of 1
                pi, log_pi, _ = actor.get_action(data.observations)
                qf1_pi = qf1(data.observations, pi)
                qf2_pi = qf2(data.observations, pi)
                min_qf_pi = torch.min(qf1_pi, qf2_pi)
                actor_loss = ((alpha * log_pi) - min_qf_pi).mean()

                actor_optimizer.zero_grad()
                actor_loss.backward()
                actor_optimizer.step()

                if args.autotune:
                    with torch.no_grad():
                        _, log_pi, _ = actor.get_action(data.observations)
                    alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()

                    a_optimizer.zero_grad()
                    alpha_loss.backward()
                    a_optimizer.step()
                    alpha = log_alpha.exp().item()

        # update the target networks
        if global_step % args.target_network_frequency == 0:
            for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
            for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)

        if global_step % 100 == 0:
            writer.add_scalar("losses/qf1_values", qf1_a_values.mean().item(), global_step)
            writer.add_scalar("losses/qf2_values", qf2_a_values.mean().item(), global_step)
            writer.add_scalar("losses/qf1_loss", qf1_loss.item(), global_step)
            writer.add_scalar("losses/qf2_loss", qf2_loss.item(), global_step)
            writer.add_scalar("losses/qf_loss", qf_loss.item() / 2.0, global_step)
            writer.add_scalar("losses/actor_loss", actor_loss.item(), global_step)
            writer.add_scalar("losses/alpha", alpha, global_step)
            print("SPS:", int(global_step / (time.time() - start_time)))
            writer.add_scalar(
                "charts/SPS",
                int(global_step / (time.time() - start_time)),
                global_step,
            )
            if args.autotune:
                writer.add_scalar("losses/alpha_loss", alpha_loss.item(), global_step)

    updates = 0
    # TRY NOT TO MODIFY: start the game
    obs, _ = envs.reset(seed=args.seed)
    for global_step in range(args.total_timesteps):
        # ALGO LOGIC: put action logic here
        if global_step < args.learning_starts:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            actions, _, _ = actor.get_action(torch.Tensor(obs).to(device))
            actions = actions.detach().cpu().numpy()

        # TRY NOT TO MODIFY: execute the game and log data.
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        # TRY NOT TO MODIFY: record rewards for plotting purposes
        if "final_info" in infos:
            for info in infos["final_info"]:
                if info is not None:
                    writer.add_scalar("charts/episodic_return", info["episode"]["r"], global_step)
                    writer.add_scalar("charts/episodic_length", info["episode"]["l"], global_step)
                    break

        # TRY NOT TO MODIFY: save data to reply buffer; handle `final_observation`
        real_next_obs = next_obs.copy()
        for idx, trunc in enumerate(truncations):
            if trunc:
                real_next_obs[idx] = infos["final_observation"][idx]
        rb.add(obs, real_next_obs, actions, rewards, terminations, infos)

        # TRY NOT TO MODIFY: CRUCIAL step easy to overlook
        obs = next_obs

        # ALGO LOGIC: training.
        if global_step > args.learning_starts:
            data = rb.sample(args.batch_size)
            update(data)
            sg.log(alpha)
            updates += 1
            if updates == steps:
                break

    sg.log([s for s in writer.scalars if s[0].startswith("losses/")])
    envs.close()
    writer.close()
