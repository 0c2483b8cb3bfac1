"""CleanRL's dqn.py (DQN on CartPole-v1): a ``QNetwork`` MLP (120-84), Adam, a target network
hard-copied every ``target_network_frequency`` steps (``target_network_param.data.copy_(tau *
q_network_param.data + (1.0 - tau) * target_network_param.data)`` with tau = 1.0), epsilon
from ``linear_schedule`` and Python ``random`` outside the step, actions from
``q_network(torch.Tensor(obs))`` (with grad, as written) and ``argmax``. Off-policy data from
the replay buffer (``rb.sample`` draws indices with ``np.random.randint`` and converts
each numpy field with ``torch.tensor(array, device=...)``, SB3's ``to_torch``: float32
observations, int64 actions gathered on).

The step is the training under ``if global_step > args.learning_starts:``: the ``if global_step
% args.train_frequency == 0:`` body (TD target from ``target_network(...).max(dim=1)`` under
``no_grad``, ``q_network(obs).gather(1, data.actions).squeeze()``, ``F.mse_loss``, the ``% 100``
logging with ``writer.add_scalar("losses/td_loss", loss, global_step)`` (a tensor) and
``old_val.mean().item()``, ``optimizer.zero_grad()``, ``backward()``, ``optimizer.step()``) and
the ``if global_step % args.target_network_frequency == 0:`` target copy after it, in one
``update(data)``. The program's structure makes the user choose here: the target copy sits
beside the ``train_frequency`` block, not in it, and the sample is inside that block. A user
keeps the sample at the call site (it is the batch) and the ``% train_frequency`` test with it,
and moves the target copy into the step: target_network_frequency (500) is a multiple of
train_frequency (10), so every target copy falls on a training step and the program's order
(train, then copy) is unchanged. ``global_step`` is read as the program reads it (main's loop
variable, a closure cell; the script's module global).

Model: vendor/cleanrl/dqn.py (``QNetwork``, ``linear_schedule``, restated: same layers, names and
forward, not a copy); replay buffer: vendor/cleanrl/buffers.py (restated likewise). Loop: the
script's ``__main__`` block as written, inside ``main``.
Scaled down / replaced: gymnasium's CartPole-v1 by ``_cleanrl_envs.CartPoles`` (its dynamics,
one env), tensorboard by a stub keeping the scalars (``losses/`` compared), no wandb/tyro, no
model saving/eval; total_timesteps 500000 -> 200 (epsilon anneals over 100 steps),
learning_starts 10000 -> 32, target_network_frequency 500 -> 20 (the 8 updates at global steps
40..110 copy the target at 40, 60, 80, 100 and log at 100); ``steps`` counts updates.
"""
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

from clients._cleanrl_envs import CartPoles, SummaryWriter
from clients.vendor.cleanrl.buffers import ReplayBuffer
from clients.vendor.cleanrl.dqn import QNetwork, linear_schedule

SOURCE = "https://github.com/vwxyzjn/cleanrl/blob/fe8d8a03c41a7ef5b523e2e354bd01c363e786bb/cleanrl/dqn.py"
LICENSE = "MIT"
TAGS = ("rl", "dqn", "off-policy", "replay-buffer", "target-network", "hard-update-data-copy",
        "gather", "item-in-step", "writer-in-step", "python-random")


@dataclass
class Args:  # dqn.py's defaults; the scaled-down ones marked
    exp_name: str = "dqn"
    seed: int = 1
    torch_deterministic: bool = True
    cuda: bool = True
    track: bool = False
    capture_video: bool = False
    save_model: bool = False
    env_id: str = "CartPole-v1"
    total_timesteps: int = 200      # 500000
    learning_rate: float = 2.5e-4
    num_envs: int = 1
    buffer_size: int = 10000
    gamma: float = 0.99
    tau: float = 1.0
    target_network_frequency: int = 20  # 500
    batch_size: int = 128
    start_e: float = 1
    end_e: float = 0.05
    exploration_fraction: float = 0.5
    learning_starts: int = 32       # 10000
    train_frequency: int = 10


def main(sg, steps=8, device="cpu", amp=None):
    args = Args()
    assert args.num_envs == 1, "vectorized envs are not supported at the moment"
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}")

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device(device)

    # env setup
    envs = CartPoles(args.num_envs, seed=args.seed)

    q_network = QNetwork(envs).to(device)
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(envs).to(device)
    target_network.load_state_dict(q_network.state_dict())
    sg.track(q_network=q_network, target_network=target_network, optimizer=optimizer)

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
            target_max, _ = target_network(data.next_observations).max(dim=1)
            td_target = data.rewards.flatten() + args.gamma * target_max * (1 - data.dones.flatten())
        old_val = q_network(data.observations).gather(1, data.actions).squeeze()
        loss = F.mse_loss(td_target, old_val)

        if global_step % 100 == 0:
            writer.add_scalar("losses/td_loss", loss, global_step)
            writer.add_scalar("losses/q_values", old_val.mean().item(), global_step)
            print("SPS:", int(global_step / (time.time() - start_time)))
            writer.add_scalar("charts/SPS", int(global_step / (time.time() - start_time)), global_step)

        # optimize the model
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        # update target network
        if global_step % args.target_network_frequency == 0:
            for target_network_param, q_network_param in zip(target_network.parameters(), q_network.parameters()):
                target_network_param.data.copy_(
                    args.tau * q_network_param.data + (1.0 - args.tau) * target_network_param.data
                )

    updates = 0
    # TRY NOT TO MODIFY: start the game
    obs, _ = envs.reset(seed=args.seed)
    for global_step in range(args.total_timesteps):
        # ALGO LOGIC: put action logic here
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
        if random.random() < epsilon:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            q_values = q_network(torch.Tensor(obs).to(device))
            actions = torch.argmax(q_values, dim=1).cpu().numpy()

        # TRY NOT TO MODIFY: execute the game and log data.
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        # TRY NOT TO MODIFY: record rewards for plotting purposes
        if "final_info" in infos:
            for info in infos["final_info"]:
                if info and "episode" in info:
                    writer.add_scalar("charts/episodic_return", info["episode"]["r"], global_step)
                    writer.add_scalar("charts/episodic_length", info["episode"]["l"], global_step)

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
            if global_step % args.train_frequency == 0:
                data = rb.sample(args.batch_size)
                update(data)
                updates += 1
                if updates == steps:
                    break

    sg.log([s for s in writer.scalars if s[0].startswith("losses/")])
    envs.close()
    writer.close()
