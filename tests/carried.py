"""Steps that carry a recurrent state in a variable their own code rebinds (capture/pyeffects.py:
live_tuple, live_input), shared by test_recurrent_state.py, test_pyvalues.py and test_cuda_loops.py.
Each maker builds a fresh model from seed 0 and returns ``(step, state)``: ``state()`` reads the
carried variable as the loop would."""
import torch
import torch.nn.functional as F
from torch import nn


def rnn_state_step(cell: str):
    """``nonlocal hidden``; detached, then rebound by an ``nn.LSTM`` (a tuple ``(h, c)``) or an
    ``nn.GRU`` (one tensor)."""
    torch.manual_seed(0)
    rnn, head = (nn.LSTM if cell == "lstm" else nn.GRU)(4, 8), nn.Linear(8, 4)
    opt = torch.optim.SGD(list(rnn.parameters()) + list(head.parameters()), lr=0.1)
    hidden = (torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)) if cell == "lstm" else torch.zeros(1, 2, 8)

    def step(x, y):
        nonlocal hidden
        hidden = tuple(h.detach() for h in hidden) if isinstance(hidden, tuple) else hidden.detach()
        out, hidden = rnn(x, hidden)
        loss = F.mse_loss(head(out), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return step, lambda: hidden


def tuple_state_step(device: str = "cpu"):
    """``x + mems[0] - 0.5 * mems[1]`` (the step reads the elements by index), then ``mems =
    (h.detach(), (2 * h).detach())``."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8).to(device)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mems = (torch.zeros(4, 8, device=device), torch.zeros(4, 8, device=device))

    def step(x):
        nonlocal mems
        h = torch.tanh(lin(x + mems[0] - 0.5 * mems[1]))
        loss = h.pow(2).mean()
        mems = (h.detach(), (2 * h).detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, lambda: mems
