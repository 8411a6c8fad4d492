"""Compute hosting: one worker process per tensor-parallel rank, the same path for one rank and for many."""
