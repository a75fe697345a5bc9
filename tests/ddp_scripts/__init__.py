"""Scripts that the DDP tests start in subprocesses, and the launcher that starts them."""
