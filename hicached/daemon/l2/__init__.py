"""L2, host memory: the pool (one sealed memfd every engine maps), the slab allocator that cuts it into
slots of several page sizes, and the page index ((namespace, key) -> slot, with leases, pins, the "not
yet in L3" state and LRU eviction)."""
