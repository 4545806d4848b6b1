"""An import-only stand-in for torchvision in the SGLang test venv (.venv-sglang).

SGLang's host-pool modules import torchvision at module level (through its configs and
multimodal processors, and through transformers), but nothing the HiCache storage tests
run uses it, and torchvision's PyPI build pulls a CUDA torch. This package makes every
``import torchvision[.x.y]`` and ``from torchvision.x import Name`` succeed; calling
anything from it raises. It is put on ``sys.path`` only in .venv-sglang (a ``.pth`` file
written by ``make test-sglang``), never in kvtier's own environment.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvtier.stub"


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's members (used as import-time constants)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(module: str, name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{module}.{name} is a stub in kvtier's SGLang test venv")

    call.__name__ = name
    return call


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        try:
            return importlib.import_module(f"{module_name}.{name}")
        except ImportError:
            return _unavailable(module_name, name)

    return __getattr__


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates an empty stub module for any ``torchvision.<anything>``."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())
__getattr__ = _module_getattr(__name__)
