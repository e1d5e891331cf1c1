"""The ground floor every layer shares: the one user-facing error type (`errors`), fault points for the
reliability tests (`faults`) and progress lines (`progress`).  It imports nothing of the project."""
