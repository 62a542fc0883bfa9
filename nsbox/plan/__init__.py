"""A sandbox's plan as pure data, and the contributors that build it.

Nothing here imports the C extension: plans are built and tested without it."""
