"""CleanRL's td3_continuous_action.py (TD3 on Hopper-v4, continuous actions): a deterministic
``Actor`` (tanh output scaled by ``action_scale``/``action_bias`` buffers) and its target, twin
``QNetwork`` critics and their targets, one Adam over both critics, one Adam for the actor.
Off-policy data from the replay buffer (``rb.sample`` draws indices with
``np.random.randint`` and converts each numpy field with ``torch.tensor(array, device=...)``,
SB3's ``to_torch``); exploration noise ``torch.normal(0, actor.action_scale *
exploration_noise)`` added outside the step.

The step is the body of ``if global_step > args.learning_starts:`` as written: target policy
smoothing under ``no_grad`` (``torch.randn_like(data.actions, device=device) * policy_noise``
clamped, ``.clamp(envs.single_action_space.low[0], envs.single_action_space.high[0])`` -- numpy
float32 scalars), both critic losses, ``q_optimizer``; then the delayed policy update ``if
global_step % args.policy_frequency == 0:`` (actor loss ``-qf1(obs, actor(obs)).mean()``,
``actor_optimizer``) with the three soft target updates inside it
(``target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)``);
then the ``if global_step % 100 == 0:`` logging (``writer.add_scalar(..., x.item(),
global_step)``, ``print("SPS: ...")``). ``global_step`` is read as the program reads it (main's
loop variable, a closure cell; the script's module global). What a user of stepgraph changes:
the body is indented into ``update(data)`` and ``data = rb.sample(args.batch_size)`` stays at
the call site (the step's batch, drawn with numpy's global generator, as a data loader's).

Model: vendor/cleanrl/td3_continuous_action.py (``QNetwork``, ``Actor``, restated: same layers,
names and ops, not a copy); replay buffer: vendor/cleanrl/buffers.py (restated likewise). Loop:
the script's ``__main__`` block as written, inside ``main``. Scaled down / replaced: Hopper-v4
by ``_cleanrl_envs.MujocoLike`` (same spaces, synthetic dynamics, 40-step episodes), tensorboard
by a stub keeping the scalars (``losses/`` compared), no wandb/tyro, no model saving/eval;
buffer_size 1e6 -> 10000, learning_starts 25e3 -> 95 (the 8 updates, global steps 96..103, take
both policy_frequency paths and the ``% 100`` logging once); ``steps`` counts updates.
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
from clients.vendor.cleanrl.td3_continuous_action import Actor, QNetwork

SOURCE = "https://github.com/vwxyzjn/cleanrl/blob/fe8d8a03c41a7ef5b523e2e354bd01c363e786bb/cleanrl/td3_continuous_action.py"
LICENSE = "MIT"
TAGS = ("rl", "td3", "off-policy", "replay-buffer", "target-network", "soft-update-data-copy",
        "policy-delay-branch", "randn-in-step", "numpy-scalar-clamp", "item-in-step", "writer-in-step")


@dataclass
class Args:  # td3_continuous_action.py's defaults; the scaled-down ones marked
    exp_name: str = "td3_continuous_action"
    seed: int = 1
    torch_deterministic: bool = True
    cuda: bool = True
    track: bool = False
    capture_video: bool = False
    save_model: bool = False
    env_id: str = "Hopper-v4"
    total_timesteps: int = 1000000
    learning_rate: float = 3e-4
    buffer_size: int = 10000        # int(1e6)
    gamma: float = 0.99
    tau: float = 0.005
    batch_size: int = 256
    policy_noise: float = 0.2
    exploration_noise: float = 0.1
    learning_starts: int = 95       # 25e3
    policy_frequency: int = 2
    noise_clip: float = 0.5


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
    envs = MujocoLike(1, seed=args.seed)

    actor = Actor(envs).to(device)
    qf1 = QNetwork(envs).to(device)
    qf2 = QNetwork(envs).to(device)
    qf1_target = QNetwork(envs).to(device)
    qf2_target = QNetwork(envs).to(device)
    target_actor = Actor(envs).to(device)
    target_actor.load_state_dict(actor.state_dict())
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.learning_rate)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.learning_rate)
    sg.track(actor=actor, qf1=qf1, qf2=qf2, qf1_target=qf1_target, qf2_target=qf2_target,
             target_actor=target_actor, q_optimizer=q_optimizer, actor_optimizer=actor_optimizer)

    envs.single_observation_space.dtype = np.float32
    rb = ReplayBuffer(
        args.buffer_size,
        envs.single_observation_space,
        envs.single_action_space,
        device,
        handle_timeout_termination=False,
    )
    start_time = time.time()

    @sg.compile
    def update(data):
        with torch.no_grad():
            clipped_noise = (torch.randn_like(data.actions, device=device) * args.policy_noise).clamp(
                -args.noise_clip, args.noise_clip
            ) * target_actor.action_scale

            next_state_actions = (target_actor(data.next_observations) + clipped_noise).clamp(
                envs.single_action_space.low[0], envs.single_action_space.high[0]
            )
            qf1_next_target = qf1_target(data.next_observations, next_state_actions)
            qf2_next_target = qf2_target(data.next_observations, next_state_actions)
            min_qf_next_target = torch.min(qf1_next_target, qf2_next_target)
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

        if global_step % args.policy_frequency == 0:
            actor_loss = -qf1(data.observations, actor(data.observations)).mean()
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()

            # update the target network
            for param, target_param in zip(actor.parameters(), target_actor.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
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
            print("SPS:", int(global_step / (time.time() - start_time)))
            writer.add_scalar(
                "charts/SPS",
                int(global_step / (time.time() - start_time)),
                global_step,
            )

    updates = 0
    # TRY NOT TO MODIFY: start the game
    obs, _ = envs.reset(seed=args.seed)
    for global_step in range(args.total_timesteps):
        # ALGO LOGIC: put action logic here
        if global_step < args.learning_starts:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            with torch.no_grad():
                actions = actor(torch.Tensor(obs).to(device))
                actions += torch.normal(0, actor.action_scale * args.exploration_noise)
                actions = actions.cpu().numpy().clip(envs.single_action_space.low, envs.single_action_space.high)

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
            updates += 1
            if updates == steps:
                break

    sg.log([s for s in writer.scalars if s[0].startswith("losses/")])
    envs.close()
    writer.close()
