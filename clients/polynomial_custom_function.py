"""PyTorch tutorials, "Defining New autograd Functions" (beginner_source/examples_autograd/
polynomial_custom_function.py): a third-order polynomial y = a + b * P3(c + d * x), P3 the
Legendre polynomial 1/2 (5x^3 - 3x), fitted to sin(x) on [-pi, pi] by hand-written gradient
descent, with P3 a custom ``torch.autograd.Function``.

The program: ``LegendrePolynomial3(torch.autograd.Function)`` with static ``forward(ctx, input)``
(``ctx.save_for_backward(input)``, returns ``0.5 * (5 * input ** 3 - 3 * input)``) and
``backward(ctx, grad_output)`` (``input, = ctx.saved_tensors``, returns ``grad_output * 1.5 * (5 *
input ** 2 - 1)``); ``x = torch.linspace(-math.pi, math.pi, 2000)``, ``y = torch.sin(x)``; four 0-dim
weights ``torch.full((), v, requires_grad=True)`` (a=0, b=-1, c=0, d=0.3); ``learning_rate = 5e-6``;
per iteration ``P3 = LegendrePolynomial3.apply``, ``y_pred = a + b * P3(c + d * x)``, ``loss =
(y_pred - y).pow(2).sum()``, ``if t % 100 == 99: print(t, loss.item())``, ``loss.backward()``, and
under ``torch.no_grad()`` ``a -= learning_rate * a.grad`` (b, c, d likewise) then ``a.grad = None``
(b, c, d likewise); at the end the fitted polynomial is printed with ``.item()``.

What is compiled: the body of ``for t in range(2000)``, as ``train_iteration(t)``: where a user
puts ``@stepgraph.compile`` on the loop body. ``x``, ``y``, the weights and ``learning_rate`` are the
program's module globals, read by the step as the program reads them; the step declares ``global
a, b, c, d`` (at module level ``a -= ...`` stores the global back, in a function it needs the
declaration).

Source: https://github.com/pytorch/tutorials/blob/c53e7d4efc0e39e455c531d21ec7db28ba220214/beginner_source/examples_autograd/polynomial_custom_function.py
BSD-3-Clause. Restated after the source, not copied: same names, ops and order. Deviations: the
loop is cut after ``steps`` iterations and the print every 100 iterations is every 4
(``t % 4 == 3``) so that it happens within them; 2000 points as the program (cheap).
"""
import math

import torch

SOURCE = ("https://github.com/pytorch/tutorials/blob/c53e7d4efc0e39e455c531d21ec7db28ba220214/"
          "beginner_source/examples_autograd/polynomial_custom_function.py")
LICENSE = "BSD-3-Clause"
TAGS = ("custom-autograd-function", "manual-sgd", "no-grad-update", "grad-none", "globals", "print-in-step",
        "item-in-step", "0-dim-params")

PRINT_EVERY = 4   # 100 in the program


class LegendrePolynomial3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return 0.5 * (5 * input ** 3 - 3 * input)

    @staticmethod
    def backward(ctx, grad_output):
        input, = ctx.saved_tensors
        return grad_output * 1.5 * (5 * input ** 2 - 1)


dtype = torch.float
x = y = a = b = c = d = None
learning_rate = 5e-6


def main(sg, steps=8, device="cpu", amp=None):
    global x, y, a, b, c, d
    device = torch.device(device)
    x = torch.linspace(-math.pi, math.pi, 2000, device=device, dtype=dtype)
    y = torch.sin(x)
    a = torch.full((), 0.0, device=device, dtype=dtype, requires_grad=True)
    b = torch.full((), -1.0, device=device, dtype=dtype, requires_grad=True)
    c = torch.full((), 0.0, device=device, dtype=dtype, requires_grad=True)
    d = torch.full((), 0.3, device=device, dtype=dtype, requires_grad=True)
    sg.track(a=a, b=b, c=c, d=d)

    @sg.compile
    def train_iteration(t):
        global a, b, c, d   # (the program's loop runs at module level: `a -= ...` is on the global)
        P3 = LegendrePolynomial3.apply
        y_pred = a + b * P3(c + d * x)

        loss = (y_pred - y).pow(2).sum()
        if t % PRINT_EVERY == PRINT_EVERY - 1:
            print(t, loss.item())

        loss.backward()

        with torch.no_grad():
            a -= learning_rate * a.grad
            b -= learning_rate * b.grad
            c -= learning_rate * c.grad
            d -= learning_rate * d.grad

            a.grad = None
            b.grad = None
            c.grad = None
            d.grad = None
        return loss

    for t in range(steps):
        loss = train_iteration(t)
        sg.log(loss)

    print(f'Result: y = {a.item()} + {b.item()} * P3({c.item()} + {d.item()} x)')
