"""Semantic anchors: recurrent-state checkpoints at agent boundaries (paper §3.1).

``markers``: the anchor token sequences and their positions in a prompt; ``plan``: where a
request's prefill ends a chunk and which states it keeps; ``states``: the kept states, with
their own budget and LRU, on SGLang's hybrid radix cache.
"""
