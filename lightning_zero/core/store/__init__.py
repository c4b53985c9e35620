"""Where the optimizer's copy lives: in place, an fp32 master, host memory or the rank's swap file (a
:class:`~lightning_zero.core.store.stores.ShardStore` each), the offload choices and their checks. A store owns
everything between a reduced gradient shard and the new parameter shard. Above ``layout``, below the stages.
"""
