"""What a device really holds, to hold plans against."""

import jax


def device0_bytes(tree) -> int:
    """Bytes device 0 holds of a tree of arrays."""
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for x in jax.tree.leaves(tree)
        for shard in x.addressable_shards
        if shard.device == device
    )
