"""CUDA graphs of the model's forward: captured at start-up, replayed per step.

`decode` holds the decode graphs (one per stream/partition and padded batch size:
`DecodeGraphs`, picked per decode stream by `DecodeGraphRegistry`); `prefill` the piecewise
prefill graphs (`PrefillGraphs`: the dense work per token bucket, cut at attention, on the
whole GPU). The runner owns both; start-up sizes and captures them.
"""
