"""Build a model from a one-line spec, as ``python -m bigconv.check`` takes it.

``library:name[:extra][:key=value,key=value]``:

- ``timm:resnet50`` -> ``timm.create_model("resnet50", pretrained=False)``
- ``torchvision:resnet18`` -> ``torchvision.models.get_model("resnet18", weights=None)``
- ``smp:Unet:resnet18`` -> ``segmentation_models_pytorch.Unet(encoder_name="resnet18", encoder_weights=None)``
- ``monai:UNet:spatial_dims=2,in_channels=1,out_channels=2,channels=(4,8),strides=(2,)`` -> ``monai.networks.nets.UNet(...)``
- ``bigconv:CNN2D`` -> ``bigconv.models.CNN2D()``
- ``path/to/file.py:build_fn`` -> ``build_fn()`` from that file

Keyword values are Python literals (``num_classes=3``, ``channels=(4,8)``); anything else is a string.
No pretrained weights are ever downloaded: the check needs the architecture only.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
from pathlib import Path

import torch.nn as nn

from ..compat import allow_torchvision_without_ops

LIBRARIES = ("timm", "torchvision", "smp", "monai", "bigconv")
FORMS = ("timm:resnet50, torchvision:resnet18, smp:Unet:resnet18, monai:UNet:spatial_dims=2,in_channels=1,"
         "out_channels=2,channels=(4,8),strides=(2,), bigconv:CNN2D, or path/to/file.py:build_fn")


def parse_kwargs(text: str) -> dict:
    """``a=1,b=(2,3),c=x`` -> ``{"a": 1, "b": (2, 3), "c": "x"}`` (commas inside brackets stay)."""
    kwargs, depth, part = {}, 0, ""
    for ch in text + ",":
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            if part.strip():
                key, sep, value = part.partition("=")
                if not sep:
                    raise ValueError(f"model argument {part!r} is not key=value; write e.g. num_classes=3")
                try:
                    kwargs[key.strip()] = ast.literal_eval(value.strip())
                except (ValueError, SyntaxError):
                    kwargs[key.strip()] = value.strip()
            part = ""
        else:
            part += ch
    return kwargs


def build_model(spec: str) -> nn.Module:
    """The model ``spec`` names, with random weights."""
    library, _, rest = spec.partition(":")
    if library.endswith(".py"):
        return _from_file(Path(library), rest)
    if library not in LIBRARIES or not rest:
        raise ValueError(f"cannot read the model spec {spec!r}; write one of {FORMS}")
    parts = rest.split(":")
    kwargs = parse_kwargs(parts[-1]) if len(parts) > 1 and "=" in parts[-1] else {}
    names = parts[:-1] if kwargs else parts
    allow_torchvision_without_ops()  # before timm/torchvision/smp, which import torchvision
    if library == "timm":
        import timm
        if not timm.is_model(names[0]):
            raise unknown_model(library, names[0], timm.list_models())
        return timm.create_model(names[0], pretrained=False, **kwargs)
    if library == "torchvision":
        import torchvision
        if names[0].lower() not in torchvision.models.list_models():
            raise unknown_model(library, names[0], torchvision.models.list_models())
        return torchvision.models.get_model(names[0], weights=None, **kwargs)
    if library == "smp":
        import segmentation_models_pytorch as smp
        if len(names) > 1:
            kwargs.setdefault("encoder_name", names[1])
        return _attribute(smp, library, names[0])(encoder_weights=None, **kwargs)
    if library == "monai":
        import monai.networks.nets as nets
        return _attribute(nets, library, names[0])(**kwargs)
    from .. import models
    return _attribute(models, library, names[0])(**kwargs)


def unknown_model(library: str, name: str, known: list[str]) -> ValueError:
    """The error for a model name ``library`` does not have: one line, with the closest names it has."""
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    hint = f"; did you mean {', '.join(f'{library}:{c}' for c in close)}?" if close else ""
    return ValueError(f"{library} has no model {name!r}{hint}")


def _attribute(module, library: str, name: str):
    if not callable(getattr(module, name, None)):
        raise unknown_model(library, name, [n for n in dir(module) if not n.startswith("_")])
    return getattr(module, name)


def _from_file(path: Path, function: str) -> nn.Module:
    if not path.is_file() or not function:
        raise ValueError(f"{path}:{function or '?'}: give an existing file and the function in it that builds "
                         "the model, e.g. my_model.py:build")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    model = getattr(module, function)()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{path}:{function}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


OPTIMIZERS = {
    "sgd": ("SGD", {"lr": 0.01}),
    "momentum": ("SGD", {"lr": 0.01, "momentum": 0.9}),
    "adam": ("Adam", {"lr": 1e-3}),
    "adamw": ("AdamW", {"lr": 1e-3, "weight_decay": 0.01}),
}
"""The optimizers named by ``--optimizer``, as the exactness check builds them (the planner counts their state
per parameter: none, one buffer, two moments)."""
OPTIMIZER_FORMS = (f"{', '.join(OPTIMIZERS)}, a class with arguments (torch.optim.RMSprop:lr=1e-3,momentum=0.9, "
                   "my_package.opt:Lion:lr=1e-4) or path/to/file.py:MyOptimizer[:key=value,...]")


def build_optimizer(spec: str) -> tuple[type, dict]:
    """The optimizer class and keyword arguments ``spec`` names (``OPTIMIZER_FORMS``)."""
    import torch

    if spec in OPTIMIZERS:
        name, kwargs = OPTIMIZERS[spec]
        return getattr(torch.optim, name), dict(kwargs)
    where, _, rest = spec.partition(":")
    name, _, args = rest.partition(":")
    if not where:
        raise ValueError(f"cannot read the optimizer {spec!r}; write one of {OPTIMIZER_FORMS}")
    if where.endswith(".py"):
        if not Path(where).is_file() or not name:
            raise ValueError(f"{spec}: give an existing file and the optimizer class in it, e.g. my_opt.py:Lion")
        module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    elif "." in where and name and "=" not in name:  # my_package.opt:Lion[:args]
        module = importlib.import_module(where)
    else:  # torch.optim.RMSprop[:args]
        module_name, _, name_in = where.rpartition(".")
        module, args, name = importlib.import_module(module_name or "torch.optim"), rest, name_in
    cls = getattr(module, name, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise ValueError(f"{spec}: {name!r} is not a torch.optim.Optimizer class; write one of {OPTIMIZER_FORMS}")
    return cls, parse_kwargs(args) if args else {}
