"""The old import path of the Inspect provider (now nsbox.inspect).

Kept so that code and configurations written against nsbox.inspect_provider
keep working; importing it registers the provider, as before. New code
imports from nsbox.inspect.provider and nsbox.inspect.config.
"""

from .inspect.config import CONFIG_FILES, NetworkSettings, NsboxConfig, SandboxSettings, load_config
from .inspect.exec_remote import NsboxExecRemoteProcess
from .inspect.provider import NsboxSandboxEnvironment, shell_command

__all__ = ["CONFIG_FILES", "NetworkSettings", "NsboxConfig", "NsboxExecRemoteProcess", "NsboxSandboxEnvironment",
           "SandboxSettings", "load_config", "shell_command"]
