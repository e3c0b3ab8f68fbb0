"""The planner: SLA-driven autoscaling of the prefill and decode pools (`kvbaton planner`), and
the profiles it plans with (`kvbaton profile`)."""
