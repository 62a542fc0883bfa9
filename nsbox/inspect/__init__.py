"""nsbox as an Inspect AI sandbox provider.

The `nsbox` entry point is nsbox.inspect.provider: importing it registers
the provider with Inspect. This package imports nothing itself, so that
nsbox.inspect.config (nsbox.yaml's model) loads without registering it.
"""
