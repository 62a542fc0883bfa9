"""From a plan to a running init: the Python side of csrc/create/."""
