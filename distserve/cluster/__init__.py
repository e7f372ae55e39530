"""A serving cluster on Ray: instances as actors, the orchestrator that routes requests between
them, failover, and the Python API (Cluster, AsyncCluster)."""
