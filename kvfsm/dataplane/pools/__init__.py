"""KV memory and its bookkeeping: the KV cache shape, device and pinned host pools, the page-aware slot
allocator and the request-to-slot table (with its host mirror). Nothing here copies or stores."""
