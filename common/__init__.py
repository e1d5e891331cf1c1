"""What every layer shares: the user-facing error type and the fault points of the kill tests."""
