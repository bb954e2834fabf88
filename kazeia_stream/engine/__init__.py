"""Numerics, synchronous and trio-free: talker, code predictor, codec decoder, sampler."""
