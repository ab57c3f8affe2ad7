"""Mechanism: model, weights, KV block pool, layer-by-layer runner, sampler.

Nothing in this package knows about online or offline requests.
"""
