"""The ground floor every layer shares: the one user-facing error type (`errors`), fault points for the
reliability tests (`faults`), progress lines (`progress`) and where the warehouse is when none is named
(`default_warehouse`).  It imports nothing of the project."""
