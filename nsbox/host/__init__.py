"""Host state and host facts: what nsbox keeps on disk and what it reads about the machine.

Imports nothing above it."""
