"""A slice at a position the step moves at every call (capture/dynslice.py): llm.c's
DataLoaderLite slices its token shard at ``self.current_position`` and advances it by ``B*T``
inside the compiled step. Each position was a new graph (RECAPTURES, then eager past
max_captures); now, after one miss, the slice reads the position at each replay."""
import os

import pytest
import torch
import torch.nn.functional as F

import stepgraph

DEVICE = "cuda" if os.environ.get("STEPGRAPH_TEST_CUDA") and torch.cuda.is_available() else "cpu"


class Loader:
    """llm.c's DataLoaderLite, one shard."""

    def __init__(self, tokens, B, T):
        self.tokens, self.B, self.T, self.process_rank = tokens, B, T, 0
        self.current_position = self.process_rank * B * T

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        buf = buf.to(torch.long)
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.current_position += B * T
        if self.current_position + (B * T + 1) > len(self.tokens):
            self.current_position = self.process_rank * B * T   # (llm.c's reset(), one shard)
        return x.to(DEVICE), y.to(DEVICE)


def run(use_sg, dtype=torch.uint16, write=False, calls=14):
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (200,)).to(dtype)
    loader = Loader(tokens, 2, 8)
    emb = torch.nn.Embedding(50, 50).to(DEVICE)
    opt = torch.optim.AdamW(emb.parameters(), lr=1e-2)

    def step():
        if write:
            loader.tokens[loader.current_position: loader.current_position + 4] += 1
        x, y = loader.next_batch()
        loss = F.cross_entropy(emb(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()
    f = stepgraph.compile(step) if use_sg else step
    losses = [f() for _ in range(calls)]
    return losses, emb.weight.detach().clone(), loader.current_position, f


@pytest.mark.parametrize("dtype", [torch.uint16, torch.int64])
def test_a_loader_position_moving_every_call_is_one_graph(dtype):
    want, got = run(False, dtype), run(True, dtype)
    f = got[3]
    if DEVICE == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
        assert torch.equal(got[1], want[1]) and got[2] == want[2]
    else:   # (AdamW in its capturable form there: equal to rounding, not bitwise)
        torch.testing.assert_close(torch.stack(got[0]), torch.stack(want[0]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        assert got[2] == want[2]
        # the shard is sliced on the CPU before the CUDA graph at each call (passes/host_prologue.py),
        # not by a replay-backend graph
        assert "backend auto chose 'replay'" not in f.explain()
    # the first position, then the moving one; the wrap-around to 0 is a branch (a variant)
    assert f.stats.captures <= 3 and f.stats.replays >= 10, f.stats.recaptures
    assert "current_position" in f.stats.recaptures[0]


def test_a_write_into_a_moving_slice_is_refused_as_eager_left_it():
    want = run(False, torch.int64, write=True, calls=4)
    # (in a CUDA step the write into the CPU shard is refused first, as CPU work there)
    with pytest.raises(stepgraph.CaptureError, match="written in place|runs on CPU tensors inside a CUDA step"):
        run(True, torch.int64, write=True, calls=4)


class LoaderLite:
    """build-nanogpt's single-process DataLoaderLite: the position reset to the literal 0."""

    def __init__(self, tokens, B, T):
        self.tokens, self.B, self.T, self.current_position = tokens, B, T, 0

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.current_position += B * T
        if self.current_position + (B * T + 1) > len(self.tokens):
            self.current_position = 0
        return x, y


class LoaderLiteTuple(LoaderLite):
    """The same with the reset as a tuple assignment (spinningup's ``self.ptr,
    self.path_start_idx = 0, 0``), which compiles to other bytecode."""

    def __init__(self, *a):
        super().__init__(*a)
        self.start = 0

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.current_position += B * T
        if self.current_position + (B * T + 1) > len(self.tokens):
            self.current_position, self.start = 0, 0
        return x, y


@pytest.mark.parametrize("loader_cls", [LoaderLite, LoaderLiteTuple])
def test_a_position_reset_to_a_literal_is_written_again_at_each_replay(loader_cls):
    """``self.current_position = 0`` when the shard runs out was refused ("the step changes the
    Python value ... (176 -> 0)"): a number the step's code stores as a literal is written again
    after each replay of the graph that took that branch."""
    def run(use_sg):
        torch.manual_seed(0)
        loader = loader_cls(torch.randint(0, 50, (200,)), 2, 8)
        emb = torch.nn.Embedding(50, 50)
        opt = torch.optim.AdamW(emb.parameters(), lr=1e-2)

        def step():
            x, y = loader.next_batch()
            loss = F.cross_entropy(emb(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.detach()
        f = stepgraph.compile(step) if use_sg else step
        out = [(f(), loader.current_position) for _ in range(26)]   # two wrap-arounds
        return out, emb.weight.detach().clone(), f

    want, got = run(False), run(True)
    assert all(torch.equal(a, b) and p == q for (a, p), (b, q) in zip(got[0], want[0]))
    assert torch.equal(got[1], want[1])
    assert got[2].stats.captures <= 3 and got[2].stats.replays >= 20, got[2].stats.recaptures
