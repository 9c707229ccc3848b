"""Trainer -> inference weight sync: zstd-compressed bf16 deltas over any store, rebuilt bitwise
(`publish`: publisher and subscriber; `codec`: the shard encoding; `stores`: where they live)."""

from composer_jax.weight_sync.publish import PublishInfo, WeightPublisher, WeightSubscriber
from composer_jax.weight_sync.stores import (
    DELTA_MODES,
    CorruptShardError,
    LocalDirStore,
    MissingVersionError,
    Store,
    TensorStoreKvStore,
    WeightSyncError,
    open_store,
)

__all__ = [
    "DELTA_MODES",
    "CorruptShardError",
    "LocalDirStore",
    "MissingVersionError",
    "PublishInfo",
    "Store",
    "TensorStoreKvStore",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightSyncError",
    "open_store",
]
