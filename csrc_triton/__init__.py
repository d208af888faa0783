"""Triton kernels and their thin launchers. No autograd and no policy: ``fastrl.ops``
validates inputs and wraps these in autograd Functions."""
