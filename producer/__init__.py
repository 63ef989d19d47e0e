"""dgr producer: the Tracker-side client that opens sessions and pushes step jobs."""
