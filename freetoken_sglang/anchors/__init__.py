"""Semantic anchors: recurrent-state checkpoints at agent boundaries (paper §3.1).

``markers``: the anchor token sequences and their positions in a prompt; ``plan``: which
anchor states a request takes and keeps; ``inside``: states taken inside a prefill forward,
with no chunk ending there; ``states``: the kept states, with their own budget and LRU, on
SGLang's hybrid radix cache; ``book``: all of it for one scheduler process.
"""
