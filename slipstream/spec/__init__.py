"""Speculative decoding's building blocks: the configuration (spec/config.py, at the config
layer), the n-gram drafter (ngram.py) and the acceptance rule (rejection.py). The EAGLE-3 draft
head is a model (model/eagle3.py).

This package's __init__ imports nothing: slipstream/config.py imports spec/config.py, and
loading the package must not pull torch into the lowest layer."""
