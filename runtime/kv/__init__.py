"""The KV cache: device block pool (kv_pool), block bookkeeping (block_manager), prefix cache."""
