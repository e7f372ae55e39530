"""The shared prefix tier: full KV blocks, keyed by the prefix cache's block hashes, in a host-memory
store on each node that every instance there reads and writes (``store``), with an LRU index
(``index``) and an engine-side client (``client``)."""
