"""sfujim/TD3: Twin Delayed DDPG, the authors' reference implementation. The step is the agent's own
method, ``policy.train(replay_buffer, batch_size)``, as a user would decorate it: it increments
``self.total_it``, samples the batch itself (``np.random.randint`` indices into numpy arrays, turned into
tensors with ``torch.FloatTensor``), computes the target under ``no_grad`` with clipped
``randn_like`` policy noise through target networks, updates the twin critic, and every
``policy_freq``-th call (a branch on the counter) updates the actor and soft-updates both target
networks with ``target_param.data.copy_(tau * param.data + (1 - tau) * target_param.data)``. The
agent is a plain object holding two modules, two target copies and two Adam optimizers (lr 3e-4).

Model and step: vendor/td3/TD3.py (verbatim); buffer: vendor/td3/utils.py (``ReplayBuffer``, verbatim).
Loop: main.py (lines 112-137): each time step adds a transition to the buffer, then
``policy.train(replay_buffer, args.batch_size)`` once ``t >= start_timesteps``. No gym here: the
environment is a seeded random walk (state_dim 11, action_dim 3, max_action 1, Hopper's sizes), actions
from ``policy.select_action`` plus Gaussian exploration noise as main.py computes them. Scaled down:
start_timesteps 32 instead of 25e3, batch 16 instead of 256, buffer 1000; no evaluation episodes.
"""
import numpy as np
import torch

from clients.vendor.td3 import TD3
from clients.vendor.td3 import utils

SOURCE = "https://github.com/sfujim/TD3/blob/34770cc/TD3.py"
LICENSE = "MIT"
TAGS = ("rl", "td3", "actor-critic", "target-networks", "soft-update-data", "method-step", "numpy-sampling-in-step",
        "python-counter-in-step", "branch-on-counter", "two-optimizers", "no-grad-block", "rng-in-step")


class args:  # argparse defaults of main.py, scaled down
    start_timesteps = 32; expl_noise = 0.1; batch_size = 16; discount = 0.99; tau = 0.005; policy_noise = 0.2
    noise_clip = 0.5; policy_freq = 2; seed = 0


def main(sg, steps=8, device="cpu", amp=None):
    TD3.device = torch.device(device)
    np.random.seed(args.seed)
    state_dim, action_dim, max_action = 11, 3, 1.0
    rng = np.random.RandomState(1)  # the environment's own randomness

    kwargs = {
        "state_dim": state_dim,
        "action_dim": action_dim,
        "max_action": max_action,
        "discount": args.discount,
        "tau": args.tau,
    }
    kwargs["policy_noise"] = args.policy_noise * max_action
    kwargs["noise_clip"] = args.noise_clip * max_action
    kwargs["policy_freq"] = args.policy_freq
    policy = TD3.TD3(**kwargs)
    replay_buffer = utils.ReplayBuffer(state_dim, action_dim, max_size=1000)
    replay_buffer.device = torch.device(device)
    sg.track(actor=policy.actor, actor_target=policy.actor_target, critic=policy.critic,
             critic_target=policy.critic_target, actor_optimizer=policy.actor_optimizer,
             critic_optimizer=policy.critic_optimizer)
    train = sg.compile(policy.train)

    state = rng.randn(state_dim)
    for t in range(args.start_timesteps + steps):
        if t < args.start_timesteps:
            action = rng.uniform(-max_action, max_action, size=action_dim)  # env.action_space.sample()
        else:
            action = (
                policy.select_action(np.array(state))
                + np.random.normal(0, max_action * args.expl_noise, size=action_dim)
            ).clip(-max_action, max_action)
        next_state = state + 0.1 * rng.randn(state_dim)                  # env.step(action)
        reward, done_bool = float(-np.square(action).sum()), float(rng.rand() < 0.05)
        replay_buffer.add(state, action, next_state, reward, done_bool)
        state = next_state if not done_bool else rng.randn(state_dim)

        if t >= args.start_timesteps:
            train(replay_buffer, args.batch_size)
            sg.log(policy.total_it)
