"""Sampling: a request's parameters, the sampler and its penalties, output constraints (grammars and their
nesting bounds), reasoning sections."""
