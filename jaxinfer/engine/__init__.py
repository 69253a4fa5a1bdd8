"""The host engine: requests, per-replica schedulers and page pools, packing steps for the device, the
loop that serves them from other threads, statistics and warm-up."""
