"""nsbox as an Inspect AI sandbox provider (the `nsbox` entry point)."""
