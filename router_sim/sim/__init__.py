"""The simulator: workers (a real cache, event manager and publisher each), their step timing,
workloads and traces, the workload's hit-rate bound, and the report."""
