"""Choosing the next token: `sampler` (batched sampling on the logits' device: penalties,
logit bias, greedy, temperature, top-k/top-p/min-p, seeds, logprobs) and `structured`
(structured outputs: llguidance grammars compiled from `response_format` /
`structured_outputs`, and the per-step token masks the runner applies before sampling).
"""
