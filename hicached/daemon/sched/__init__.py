"""The schedulers: `tiers` (what each request does to L2 and L3), `backup` (L2 -> L3, write-through or
write-back), `prefetch` (L3 -> L2 by priority), and `backend` (the attached L3 connector: timing,
in-flight tracking for swaps, the circuit breaker). The refill of L2 after a cold start (the warm list)
lives in hicached.daemon.persist, above."""
