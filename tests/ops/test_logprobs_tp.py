"""Tensor-parallel vocabulary for linear_logprobs: two real processes on gloo (CPU).

Each rank holds a contiguous slice of the LM head rows (unequal sizes on purpose); the
op must give every rank the logp/entropy and grad_hidden of the unsplit op, and each
rank the matching slice of grad_weight/grad_bias.
"""

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, errfile):
    try:
        # CPU tensors on gloo: the Triton kernels run in the interpreter (set before triton
        # is imported in this fresh process), also on machines that have a GPU
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        from fastrl.ops.logprobs import linear_logprobs

        torch.manual_seed(0)  # same full inputs on every rank
        N, H, V = 13, 24, 157
        h = torch.randn(N, H)
        w = torch.randn(V, H) * 0.4
        b = torch.randn(V) * 0.3
        y = torch.randint(0, V, (N,))
        y[[2, 7]] = -100
        y[0], y[1] = 0, V - 1  # targets in the first and the last shard
        gl, ge = torch.randn(N), torch.randn(N)
        bounds = [0, 60, V]  # unequal shards: 60 and 97 rows
        lo, hi = bounds[rank], bounds[rank + 1]

        def run(weight, bias, group):
            hh = h.clone().requires_grad_()
            ww = weight.clone().requires_grad_()
            bb = bias.clone().requires_grad_()
            logp, ent = linear_logprobs(hh, ww, y, bias=bb, temperature=0.8, return_entropy=True,
                                        process_group=group, backend=backend)
            ((logp * gl).sum() + (ent * ge).sum()).backward()
            return logp, ent, hh.grad, ww.grad, bb.grad

        full = run(w, b, None)
        part = run(w[lo:hi], b[lo:hi], dist.group.WORLD)
        torch.testing.assert_close(part[0], full[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(part[1], full[1], atol=1e-5, rtol=0)
        torch.testing.assert_close(part[2], full[2], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(part[3], full[3][lo:hi], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(part[4], full[4][lo:hi], atol=1e-5, rtol=1e-4)
        assert (part[0][[2, 7]] == 0).all()
        # the fused policy loss over a vocab-parallel LM head equals the unsplit one
        from fastrl.config import PolicyLossConfig
        from fastrl.ops import fused_linear_policy_loss

        B, T = 1, N
        mask = (y != -100).float().view(B, T)
        old = torch.randn(B, T) * 0.1 - 5.0
        adv = torch.randn(B)

        def run_loss(weight, group):
            hh = h.view(B, T, H).clone().requires_grad_()
            ww = weight.clone().requires_grad_()
            loss, metrics = fused_linear_policy_loss(
                hh, ww, y.clamp(min=0).view(B, T), old, adv, mask, config=PolicyLossConfig(entropy_coef=0.01),
                process_group=group, backend=backend)
            loss.backward()
            return loss, metrics, hh.grad, ww.grad

        lf, mf, ghf, gwf = run_loss(w, None)
        lp, mp, ghp, gwp = run_loss(w[lo:hi], dist.group.WORLD)
        torch.testing.assert_close(lp, lf, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(mp["entropy_mean"], mf["entropy_mean"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ghp, ghf, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(gwp, gwf[lo:hi], atol=1e-6, rtol=1e-4)
        # out-of-range targets are checked against the total vocabulary, not the shard
        y_bad = y.clone()
        y_bad[3] = V
        try:
            linear_logprobs(h, w[lo:hi], y_bad, process_group=dist.group.WORLD, backend=backend)
        except ValueError as e:
            assert "targets" in str(e) and str(V) in str(e)
        else:
            raise AssertionError("out-of-range target was accepted")
        dist.destroy_process_group()
    except BaseException as e:  # report to the parent, which fails the test
        import traceback

        with open(errfile, "a") as f:
            f.write(f"rank {rank}: {traceback.format_exc()}\n")
        raise


@pytest.mark.parametrize("backend", ["torch", "triton", "chunked"])
def test_vocab_parallel_matches_unsplit_op(backend):
    with tempfile.NamedTemporaryFile("r", suffix=".err") as err:
        try:
            mp.spawn(_worker, args=(2, _free_port(), backend, err.name), nprocs=2, join=True)
        except Exception:
            pytest.fail(err.read() or "a worker failed")
        assert err.read() == ""
