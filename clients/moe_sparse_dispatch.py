"""davidmrau/mixture-of-experts: the sparsely-gated mixture-of-experts layer of "Outrageously Large
Neural Networks" (Shazeer et al. 2017), a PyTorch port of tensor2tensor's expert_utils. ``MoE``
(moe.py): ``num_experts`` ``MLP`` experts (Linear - ReLU - Linear - Softmax(1)), ``w_gate`` and
``w_noise`` parameters initialised to zeros, ``mean``/``std`` buffers for a ``Normal``;
``noisy_top_k_gating`` (clean logits ``x @ w_gate``, in training noise ``randn_like(clean_logits)
* (softplus(x @ w_noise) + 1e-2)``, softmax, ``topk(k + 1)``, the top-k renormalised and
``scatter``ed into a zeros matrix), the load estimate ``_prob_in_top_k`` (``gather`` of the
thresholds from the flattened top values, ``Normal.cdf``, ``torch.where``), the auxiliary
load-balancing loss ``cv_squared(importance) + cv_squared(load)`` times ``loss_coef``; then the
``SparseDispatcher``: ``torch.nonzero(gates).sort(0)``, the batch index of each (expert, sample)
pair by indexing a second ``nonzero(gates)``, the per-expert batch sizes
``(gates > 0).sum(0).tolist()`` (a host read of ints), ``dispatch`` = ``inp[batch_index]`` then
``torch.split(.., part_sizes)`` (one data-dependent-sized batch per expert), each expert run on its
slice, ``combine`` = ``cat``, times the nonzero gates, ``zeros(..).index_add(0, batch_index, ..)``.

Loop: example.py's ``train(x, y, model, loss_fn, optim)``: ``model(x.float())`` -> ``(y_hat,
aux_loss)``, ``CrossEntropyLoss``, ``total_loss = loss + aux_loss``, ``optim.zero_grad()``,
``backward()``, ``Adam`` ``step()``, ``print("Training Results - loss: {:.2f}, aux_loss: {:.3f}"
.format(loss.item(), aux_loss.item()))``, ``return model``. What a user of stepgraph changes:
``train`` is decorated (``@stepgraph.compile``); its print is kept as the two ``.item()`` reads it
formats (the corpus's convention: no stdout), ``return model`` as written. example.py
calls ``train`` once on one ``dummy_data`` batch; here it is called ``steps`` times, each on a new
``dummy_data(batch_size, input_size, num_classes)`` batch (``torch.rand`` / ``torch.randint`` as
example.py draws them), as cifar10_example.py's loop calls its body per batch. The ``eval`` at the
end runs as example.py does (``model.eval()``, no noise, the same dispatcher); its printed
``loss.item()``, ``aux_loss.item()`` are logged. Sizes are
example.py's (input 1000, 20 classes, 10 experts, hidden 64, batch 5, k 4). CPU only here:
example.py picks CUDA when present; ``combine`` builds its zeros on ``stitched.device``.

Source: https://github.com/davidmrau/mixture-of-experts/blob/f662999727109357c42074997e9a6cd72806f668/moe.py
(and example.py at that commit), GPL-3.0 (Copyright David Rau). Restated after the source, not
copied: same modules, names, ops, initialisation and semantics.
"""
import torch
import torch.nn as nn
from torch.distributions.normal import Normal
from torch.optim import Adam

SOURCE = "https://github.com/davidmrau/mixture-of-experts/blob/f662999727109357c42074997e9a6cd72806f668/moe.py"
LICENSE = "GPL-3.0"
TAGS = ("moe", "top-k-gating", "nonzero", "data-dependent-shape", "tolist-in-step", "split-by-sizes",
        "index-add", "scatter", "randn-in-step", "normal-cdf", "aux-loss", "item-in-step",
        "returns-module")


class SparseDispatcher(object):
    """Splits a batch by expert (the samples whose gate for that expert is nonzero) and combines
    the experts' outputs weighted by the gates (moe.py's class, same steps)."""

    def __init__(self, num_experts, gates):
        self._gates = gates
        self._num_experts = num_experts
        # the (batch, expert) pairs with a nonzero gate, sorted by expert
        sorted_experts, index_sorted_experts = torch.nonzero(gates).sort(0)
        _, self._expert_index = sorted_experts.split(1, dim=1)
        # the batch element of each pair, in expert order
        self._batch_index = torch.nonzero(gates)[index_sorted_experts[:, 1], 0]
        # how many samples each expert gets
        self._part_sizes = (gates > 0).sum(0).tolist()
        gates_exp = gates[self._batch_index.flatten()]
        self._nonzero_gates = torch.gather(gates_exp, 1, self._expert_index)

    def dispatch(self, inp):
        inp_exp = inp[self._batch_index].squeeze(1)
        return torch.split(inp_exp, self._part_sizes, dim=0)

    def combine(self, expert_out, multiply_by_gates=True):
        stitched = torch.cat(expert_out, 0)
        if multiply_by_gates:
            stitched = stitched.mul(self._nonzero_gates)
        zeros = torch.zeros(self._gates.size(0), expert_out[-1].size(1), requires_grad=True,
                            device=stitched.device)
        combined = zeros.index_add(0, self._batch_index, stitched.float())
        return combined

    def expert_to_gates(self):
        return torch.split(self._nonzero_gates, self._part_sizes, dim=0)


class MLP(nn.Module):
    def __init__(self, input_size, output_size, hidden_size):
        super(MLP, self).__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, output_size)
        self.relu = nn.ReLU()
        self.soft = nn.Softmax(1)

    def forward(self, x):
        out = self.fc1(x)
        out = self.relu(out)
        out = self.fc2(out)
        out = self.soft(out)
        return out


class MoE(nn.Module):
    """A sparsely gated mixture of 1-hidden-layer feed-forward experts (moe.py's ``MoE``)."""

    def __init__(self, input_size, output_size, num_experts, hidden_size, noisy_gating=True, k=4):
        super(MoE, self).__init__()
        self.noisy_gating = noisy_gating
        self.num_experts = num_experts
        self.output_size = output_size
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.k = k
        self.experts = nn.ModuleList([MLP(self.input_size, self.output_size, self.hidden_size)
                                      for i in range(self.num_experts)])
        self.w_gate = nn.Parameter(torch.zeros(input_size, num_experts), requires_grad=True)
        self.w_noise = nn.Parameter(torch.zeros(input_size, num_experts), requires_grad=True)

        self.softplus = nn.Softplus()
        self.softmax = nn.Softmax(1)
        self.register_buffer("mean", torch.tensor([0.0]))
        self.register_buffer("std", torch.tensor([1.0]))
        assert(self.k <= self.num_experts)

    def cv_squared(self, x):
        """Squared coefficient of variation (0 for a single value)."""
        eps = 1e-10
        if x.shape[0] == 1:
            return torch.tensor([0], device=x.device, dtype=x.dtype)
        return x.float().var() / (x.float().mean()**2 + eps)

    def _gates_to_load(self, gates):
        return (gates > 0).sum(0)

    def _prob_in_top_k(self, clean_values, noisy_values, noise_stddev, noisy_top_values):
        batch = clean_values.size(0)
        m = noisy_top_values.size(1)
        top_values_flat = noisy_top_values.flatten()

        threshold_positions_if_in = torch.arange(batch, device=clean_values.device) * m + self.k
        threshold_if_in = torch.unsqueeze(torch.gather(top_values_flat, 0, threshold_positions_if_in), 1)
        is_in = torch.gt(noisy_values, threshold_if_in)
        threshold_positions_if_out = threshold_positions_if_in - 1
        threshold_if_out = torch.unsqueeze(torch.gather(top_values_flat, 0, threshold_positions_if_out), 1)
        normal = Normal(self.mean, self.std)
        prob_if_in = normal.cdf((clean_values - threshold_if_in)/noise_stddev)
        prob_if_out = normal.cdf((clean_values - threshold_if_out)/noise_stddev)
        prob = torch.where(is_in, prob_if_in, prob_if_out)
        return prob

    def noisy_top_k_gating(self, x, train, noise_epsilon=1e-2):
        clean_logits = x @ self.w_gate
        if self.noisy_gating and train:
            raw_noise_stddev = x @ self.w_noise
            noise_stddev = ((self.softplus(raw_noise_stddev) + noise_epsilon))
            noisy_logits = clean_logits + (torch.randn_like(clean_logits) * noise_stddev)
            logits = noisy_logits
        else:
            logits = clean_logits

        # top k + 1 (the (k+1)-th is the threshold for the load estimate)
        logits = self.softmax(logits)
        top_logits, top_indices = logits.topk(min(self.k + 1, self.num_experts), dim=1)
        top_k_logits = top_logits[:, :self.k]
        top_k_indices = top_indices[:, :self.k]
        top_k_gates = top_k_logits / (top_k_logits.sum(1, keepdim=True) + 1e-6)

        zeros = torch.zeros_like(logits, requires_grad=True)
        gates = zeros.scatter(1, top_k_indices, top_k_gates)

        if self.noisy_gating and self.k < self.num_experts and train:
            load = (self._prob_in_top_k(clean_logits, noisy_logits, noise_stddev, top_logits)).sum(0)
        else:
            load = self._gates_to_load(gates)
        return gates, load

    def forward(self, x, loss_coef=1e-2):
        gates, load = self.noisy_top_k_gating(x, self.training)
        importance = gates.sum(0)
        loss = self.cv_squared(importance) + self.cv_squared(load)
        loss *= loss_coef

        dispatcher = SparseDispatcher(self.num_experts, gates)
        expert_inputs = dispatcher.dispatch(x)
        gates = dispatcher.expert_to_gates()
        expert_outputs = [self.experts[i](expert_inputs[i]) for i in range(self.num_experts)]
        y = dispatcher.combine(expert_outputs)
        return y, loss


def train(x, y, model, loss_fn, optim):
    y_hat, aux_loss = model(x.float())
    loss = loss_fn(y_hat, y)
    total_loss = loss + aux_loss
    optim.zero_grad()
    total_loss.backward()
    optim.step()

    loss.item(), aux_loss.item()   # print("Training Results - loss: {:.2f}, aux_loss: {:.3f}".format(..))
    return model


def eval(x, y, model, loss_fn):
    model.eval()
    y_hat, aux_loss = model(x.float())
    loss = loss_fn(y_hat, y)
    total_loss = loss + aux_loss
    # print("Evaluation Results - loss: {:.2f}, aux_loss: {:.3f}".format(loss.item(), aux_loss.item()))
    return loss.item(), aux_loss.item()


def dummy_data(batch_size, input_size, num_classes):
    x = torch.rand(batch_size, input_size)
    y = torch.randint(num_classes, (batch_size, 1)).squeeze(1)
    return x, y


# arguments (example.py's)
input_size = 1000
num_classes = 20
num_experts = 10
hidden_size = 64
batch_size = 5
k = 4


def main(sg, steps=8, device="cpu", amp=None):
    global train
    train = sg.compile(train)   # = @stepgraph.compile above ``def train``
    device = torch.device(device)

    model = MoE(input_size, num_classes, num_experts, hidden_size, k=k, noisy_gating=True)
    model = model.to(device)
    loss_fn = nn.CrossEntropyLoss()
    optim = Adam(model.parameters())
    sg.track(model=model, optim=optim)

    for _ in range(steps):
        x, y = dummy_data(batch_size, input_size, num_classes)
        model = train(x.to(device), y.to(device), model, loss_fn, optim)
    x, y = dummy_data(batch_size, input_size, num_classes)
    sg.log(eval(x.to(device), y.to(device), model, loss_fn))
