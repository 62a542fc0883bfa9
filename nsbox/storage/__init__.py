"""Images: references, registry pulls, the content-addressed layer store, imports and the layer applier.

The entry point for running an image is `resolve(Store(runner=...), ref)`
(resolve.py): it pulls (or finds) the image, unpacks its layers once for
this user's id mapping and returns an `Image` with the layer directories
(lowest first) and the parsed config. Unpacking runs in a sandbox made by
the runner the caller passes (confined.py; nsbox.sandbox.confined).
"""

from .config import ImageConfig
from .reference import Reference, ReferenceError
from .reference import parse as parse_reference
from .store import Image, ImageNotFound, PruneReport, Record, Store

__all__ = ["Image", "ImageConfig", "ImageNotFound", "PruneReport", "Record", "Reference", "ReferenceError", "Store",
           "parse_reference"]
