"""Client-side serving benchmark: workloads, latency metrics, SLO attainment and goodput, plots."""
