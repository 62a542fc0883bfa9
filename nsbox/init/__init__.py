"""Speaking to a running sandbox: the init's protocol, commands, files and users.

The Python side of csrc/init/."""
