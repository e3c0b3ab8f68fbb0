"""Generated deployments: `kvbaton deploy kubernetes` (kubernetes.py)."""
