"""How elements map to ranks: flat element ranges or whole tensors per owner (``pieces``), the flat parameter
buffers that hold a group of parameters and this rank's shard of them, the owners' agreement, optimizer state sliced
to a rank's pieces, and parameters whose values rest in shards. Below the stores and stages; above ``comm`` only.
"""
