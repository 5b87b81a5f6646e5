"""Turning logits into tokens: the sampler, penalties and grammar masks (xgrammar)."""
