"""dragen1860/MAML-Pytorch: MAML with a functional learner, here on Finn et al.'s sinusoid
regression (the repository trains Omniglot / mini-ImageNet classification; the meta-learner and
the learner are used unchanged but for the loss, MSE for cross-entropy).

``Learner``: a ``config`` list of ``(name, param)`` layers whose weights live in one
``nn.ParameterList`` ``self.vars`` (``linear``: a ``[out, in]`` weight, ``torch.ones`` then
``kaiming_normal_``, and a zero bias), ``parameters()`` overridden to return ``self.vars``, and a
``forward(x, vars=None, bn_training=True)`` that walks the config with ``F.linear(x, w, b)`` /
``F.relu(x, inplace=param[0])`` on ``vars`` (the module's own when None, else fast weights).
``Meta.forward(x_spt, y_spt, x_qry, y_qry)`` is one meta-training step: for each task ``i``,
the support loss of ``self.net`` and ``grad = torch.autograd.grad(loss, self.net.parameters())``
(no ``create_graph``: the inner gradients are constants, so this is first-order MAML as written),
``fast_weights = list(map(lambda p: p[1] - self.update_lr * p[0], zip(grad,
self.net.parameters())))``; the query loss before and after that update under ``torch.no_grad()``
(``losses_q[0]``, ``losses_q[1]``); then ``update_step - 1`` more inner steps, each
``torch.autograd.grad(loss, fast_weights)`` and the same ``map`` / ``lambda`` update, with the
query loss on the new fast weights added to ``losses_q[k + 1]`` (with grad). After the tasks:
``loss_q = losses_q[-1] / task_num``, ``self.meta_optim.zero_grad()``, ``loss_q.backward()``,
``self.meta_optim.step()`` (``optim.Adam(self.net.parameters(), lr=meta_lr)``, built in
``Meta.__init__``). The classification version also counts ``corrects`` with ``.item()`` per
inner step and returns ``accs``; a regression has no accuracy, so this one returns the
``losses_q`` (the per-step query losses summed over tasks) for the loop's print instead.

The step function is the train loop's ``accs = maml(x_spt, y_spt, x_qry, y_qry)`` (Meta.forward
is the whole meta step, as omniglot_train.py calls it); tasks are sampled outside it, by the data
source: per task an amplitude in [0.1, 5.0] and a phase in [0, pi], K support and K query x in
[-5, 5] (numpy), the batch stacked as ``[task_num, K, 1]`` tensors, as ``db_train.next()`` gives.

Network: Finn et al.'s sinusoid regressor, ``[('linear', [40, 1]), ('relu', [True]),
('linear', [40, 40]), ('relu', [True]), ('linear', [1, 40])]``, scaled to 16 hidden units.
Scaled down: task_num 32 -> 4, K (k_spt = k_qry) 5, update_step 5 -> 3, update_lr 0.01 (Finn's
sinusoid value; the omniglot default is 0.4), meta_lr 1e-3 as there, the print interval 50 -> 4.
The ``name is 'linear'`` tests of the source (string identity, a SyntaxWarning in Python 3.8+)
are ``==`` here.

Source: https://github.com/dragen1860/MAML-Pytorch/blob/98a00d41724c133bd29619a2fb2cc46dd128a368/meta.py
(and learner.py, omniglot_train.py there), MIT, Copyright (c) 2019 Jackie Loong. Restated after
the source, not copied.
"""
import numpy as np
import torch
from torch import nn, optim
from torch.nn import functional as F

SOURCE = "https://github.com/dragen1860/MAML-Pytorch/blob/98a00d41724c133bd29619a2fb2cc46dd128a368/meta.py"
LICENSE = "MIT"
TAGS = ("meta-learning", "maml", "first-order", "autograd.grad", "fast-weights", "functional-forward",
        "parameterlist", "inplace-relu", "no_grad-in-step", "adam")


class Learner(nn.Module):
    def __init__(self, config, imgc, imgsz):
        super(Learner, self).__init__()
        self.config = config
        # every tensor that is optimised
        self.vars = nn.ParameterList()
        # running_mean / running_var of the bn layers
        self.vars_bn = nn.ParameterList()

        for i, (name, param) in enumerate(self.config):
            if name == 'linear':
                # [ch_out, ch_in]
                w = nn.Parameter(torch.ones(*param))
                torch.nn.init.kaiming_normal_(w)
                self.vars.append(w)
                # [ch_out]
                self.vars.append(nn.Parameter(torch.zeros(param[0])))
            elif name == 'bn':
                w = nn.Parameter(torch.ones(param[0]))
                self.vars.append(w)
                self.vars.append(nn.Parameter(torch.zeros(param[0])))
                running_mean = nn.Parameter(torch.zeros(param[0]), requires_grad=False)
                running_var = nn.Parameter(torch.ones(param[0]), requires_grad=False)
                self.vars_bn.extend([running_mean, running_var])
            elif name in ['tanh', 'relu', 'upsample', 'avg_pool2d', 'max_pool2d',
                          'flatten', 'reshape', 'leakyrelu', 'sigmoid']:
                continue
            else:
                raise NotImplementedError   # (conv2d / convt2d: not in this config)

    def forward(self, x, vars=None, bn_training=True):
        if vars is None:
            vars = self.vars

        idx = 0
        bn_idx = 0
        for name, param in self.config:
            if name == 'linear':
                w, b = vars[idx], vars[idx + 1]
                x = F.linear(x, w, b)
                idx += 2
            elif name == 'bn':
                w, b = vars[idx], vars[idx + 1]
                running_mean, running_var = self.vars_bn[bn_idx], self.vars_bn[bn_idx + 1]
                x = F.batch_norm(x, running_mean, running_var, weight=w, bias=b, training=bn_training)
                idx += 2
                bn_idx += 2
            elif name == 'flatten':
                x = x.view(x.size(0), -1)
            elif name == 'relu':
                x = F.relu(x, inplace=param[0])
            elif name == 'tanh':
                x = F.tanh(x)
            elif name == 'sigmoid':
                x = torch.sigmoid(x)
            else:
                raise NotImplementedError

        # every var used
        assert idx == len(vars)
        assert bn_idx == len(self.vars_bn)
        return x

    def zero_grad(self, vars=None):
        with torch.no_grad():
            if vars is None:
                for p in self.vars:
                    if p.grad is not None:
                        p.grad.zero_()
            else:
                for p in vars:
                    if p.grad is not None:
                        p.grad.zero_()

    def parameters(self):
        """Overridden: the ParameterList itself (not a generator)."""
        return self.vars


class Meta(nn.Module):
    """The meta-learner."""

    def __init__(self, args, config):
        super(Meta, self).__init__()
        self.update_lr = args.update_lr
        self.meta_lr = args.meta_lr
        self.k_spt = args.k_spt
        self.k_qry = args.k_qry
        self.task_num = args.task_num
        self.update_step = args.update_step
        self.update_step_test = args.update_step_test

        self.net = Learner(config, args.imgc, args.imgsz)
        self.meta_optim = optim.Adam(self.net.parameters(), lr=self.meta_lr)

    def forward(self, x_spt, y_spt, x_qry, y_qry):
        """x_spt: [b, setsz, 1], y_spt: [b, setsz, 1], x_qry / y_qry: [b, querysz, 1]"""
        task_num, setsz, _ = x_spt.size()

        losses_q = [0 for _ in range(self.update_step + 1)]   # losses_q[i]: the loss after i updates

        for i in range(task_num):
            # 1. the i-th task's loss at k=0
            logits = self.net(x_spt[i], vars=None, bn_training=True)
            loss = F.mse_loss(logits, y_spt[i])
            grad = torch.autograd.grad(loss, self.net.parameters())
            fast_weights = list(map(lambda p: p[1] - self.update_lr * p[0], zip(grad, self.net.parameters())))

            # the query loss before the first update
            with torch.no_grad():
                logits_q = self.net(x_qry[i], self.net.parameters(), bn_training=True)
                loss_q = F.mse_loss(logits_q, y_qry[i])
                losses_q[0] += loss_q

            # the query loss after the first update
            with torch.no_grad():
                logits_q = self.net(x_qry[i], fast_weights, bn_training=True)
                loss_q = F.mse_loss(logits_q, y_qry[i])
                losses_q[1] += loss_q

            for k in range(1, self.update_step):
                # 1. the support loss at k = 1 .. K-1
                logits = self.net(x_spt[i], fast_weights, bn_training=True)
                loss = F.mse_loss(logits, y_spt[i])
                # 2. its grad on theta_pi
                grad = torch.autograd.grad(loss, fast_weights)
                # 3. theta_pi = theta_pi - train_lr * grad
                fast_weights = list(map(lambda p: p[1] - self.update_lr * p[0], zip(grad, fast_weights)))

                logits_q = self.net(x_qry[i], fast_weights, bn_training=True)
                # only the last update step's loss_q is kept for the meta update
                loss_q = F.mse_loss(logits_q, y_qry[i])
                losses_q[k + 1] += loss_q

        # end of all tasks: the query losses summed over tasks
        loss_q = losses_q[-1] / task_num

        # optimise theta
        self.meta_optim.zero_grad()
        loss_q.backward()
        self.meta_optim.step()

        return losses_q


class args:  # argparse defaults of omniglot_train.py, adapted to the sinusoid and scaled down
    epoch = 8; k_spt = 5; k_qry = 5; imgsz = 1; imgc = 1; task_num = 4
    meta_lr = 1e-3; update_lr = 0.01; update_step = 3; update_step_test = 10


class SinusoidNShot:
    """Sinusoid tasks: amplitude U[0.1, 5], phase U[0, pi], x U[-5, 5]; ``next()`` gives
    ``x_spt, y_spt, x_qry, y_qry`` as float32 numpy arrays of shape [task_num, K, 1]."""

    def __init__(self, batchsz, k_shot, k_query):
        self.batchsz, self.k_shot, self.k_query = batchsz, k_shot, k_query

    def next(self):
        amp = np.random.uniform(0.1, 5.0, (self.batchsz, 1, 1))
        phase = np.random.uniform(0, np.pi, (self.batchsz, 1, 1))
        x = np.random.uniform(-5.0, 5.0, (self.batchsz, self.k_shot + self.k_query, 1))
        y = amp * np.sin(x - phase)
        x, y = x.astype(np.float32), y.astype(np.float32)
        return x[:, :self.k_shot], y[:, :self.k_shot], x[:, self.k_shot:], y[:, self.k_shot:]


def main(sg, steps=8, device="cpu", amp=None):
    config = [
        ('linear', [16, 1]),
        ('relu', [True]),
        ('linear', [16, 16]),
        ('relu', [True]),
        ('linear', [1, 16]),
    ]
    maml = Meta(args, config).to(device)
    sg.track(net=maml.net, meta_optim=maml.meta_optim)

    db_train = SinusoidNShot(batchsz=args.task_num, k_shot=args.k_spt, k_query=args.k_qry)

    @sg.compile
    def meta_step(x_spt, y_spt, x_qry, y_qry):
        return maml(x_spt, y_spt, x_qry, y_qry)

    for step in range(min(args.epoch, steps)):
        x_spt, y_spt, x_qry, y_qry = db_train.next()
        x_spt, y_spt, x_qry, y_qry = torch.from_numpy(x_spt).to(device), torch.from_numpy(y_spt).to(device), \
            torch.from_numpy(x_qry).to(device), torch.from_numpy(y_qry).to(device)

        losses_q = meta_step(x_spt, y_spt, x_qry, y_qry)
        sg.log(losses_q)

        if step % 4 == 0:
            np.array([l.item() for l in losses_q]) / args.task_num   # print('step:', step, '\ttraining loss:', ...)
