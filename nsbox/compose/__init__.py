"""Docker Compose files read into nsbox's own model.

Inspect hands Docker-compatible providers a compose file, a Dockerfile, its
ComposeConfig or nothing; this package reads each leniently (every form
compose accepts), says clearly what nsbox cannot honour, and maps services
onto SandboxSpecs. It creates no sandboxes.

    project = load_project(Path("compose.yaml"))
    network = sample_network(project)          # "services" (a namespace each), or "none", "nat", "host"
    spec = service_spec(project.default_service, project, image=ref, network=network,
                        volume_root=sample_dir / "volumes")
"""

from .errors import ComposeError
from .interpolate import interpolate, substitute
from .load import COMPOSE_FILES, dockerfile_project, load_project, project_environment, project_from_config
from .mapping import main_command, service_spec
from .model import Build, Healthcheck, Mount, NetworkDef, Project, Service, VolumeDef
from .support import aliases, sample_network

__all__ = [
    "COMPOSE_FILES", "Build", "ComposeError", "Healthcheck", "Mount", "NetworkDef", "Project", "Service",
    "VolumeDef", "aliases", "dockerfile_project", "interpolate", "load_project", "main_command",
    "project_environment", "project_from_config", "sample_network", "service_spec", "substitute",
]
