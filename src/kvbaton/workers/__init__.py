"""Worker processes: each serves an engine's endpoints through the runtime."""
