"""pairmine operators: one module per stage, each a plain class over a batch of document rows.

Operators never import ray; ``pipeline.ray_adapter`` maps them onto Ray Data. Pure formulas (centrality, RRF)
are plain functions that tests call with hand-checkable numbers.
"""
