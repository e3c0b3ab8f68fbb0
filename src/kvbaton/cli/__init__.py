"""The `kvbaton` command."""
