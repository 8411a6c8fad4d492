"""Tensor operations on the flat token stream, each with a plain-PyTorch reference beside the fast path."""
