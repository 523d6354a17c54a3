"""stepserve: diffusion serving on Ray Serve, scheduled at the granularity of the denoising step.

Importing the package is cheap; the public names below load on first use.
"""

__version__ = "0.1.0"

_PUBLIC = {
    "StepserveClient": "stepserve.client",
    "APIError": "stepserve.deployments.errors",
    "AppConfig": "stepserve.deployments.config",
    "ImageGenerationRequest": "stepserve.deployments.protocol",
    "ImageEditRequest": "stepserve.deployments.protocol",
    "build_app": "stepserve.deployments.app",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'stepserve' has no attribute {name!r}")


__all__ = sorted(_PUBLIC)
