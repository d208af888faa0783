"""Plain-PyTorch specification of every op: the oracle the kernels are tested against.

Short, readable code with the formula in each docstring and no performance tricks. It
also serves as the CPU fallback where no faster path exists.
"""
